"""specjax: loose speculative decoding for Llama-family models in JAX.

    import specjax
    from specjax import models, verify
    m = models.load("smollm2-135m-instruct")
    out = specjax.Engine(target=m, draft="pld", method=verify.Fly(), max_new_tokens=64).generate(
        [m.tokenizer.chat_prompt_ids("Hello")])

The path of a request: `Engine.generate` -> `loop.Program.run` (prefill, then one
while_loop of rounds: drafter.propose -> Program.score -> rule(...) -> Program.commit)
-> tokens, and `metrics.statistics` of the loop's counters.

Shape legend. Array names carry their shape as a suffix of these letters, no
separators (`logits_BRV`, `n_B`, `cache_k_NBSGDh`):

    B  rows of a batch                 V  vocabulary
    T  prompt / fed tokens             D  model width
    S  cache length (max_len)          F  MLP width
    K  draft tokens per round          H  query heads
    R  scored positions, K + 1         G  key/value heads
    J  tokens a row emits in a commit  Q  query heads per key/value head, H / G
    W  a compiled verify width         Dh head dim
    N  layers                          P  pairs given to a CSD memory
    C  slots of a CSD memory table     E  entries of a memory update
    M  rows of a flattened [..., V] block in a kernel; Y vocabulary splits (or shards) there

As base names, `L` is the target's logits and `d`, `t`, `n` the drafts, the
target's argmax and the accepted count, as docs/rules.md writes them.
"""

from specjax import models
from specjax.engine import Engine, GenerateOutput

__all__ = ["Engine", "GenerateOutput", "models"]
