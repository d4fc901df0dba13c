"""specjax: loose speculative decoding for Llama-family models in JAX.

    import specjax
    from specjax import models, verify
    m = models.load("smollm2-135m-instruct")
    out = specjax.Engine(target=m, draft="pld", method=verify.Fly(), max_new_tokens=64).generate(
        [m.tokenizer.chat_prompt_ids("Hello")])

The path of a request: `Engine.generate` -> `loop.Program.run` (prefill, then one
while_loop of rounds: drafter.propose -> Program.score -> rule(...) -> Program.commit)
-> tokens, and `loop.statistics` of the loop's counters.

Array names carry their shape as a suffix of one-letter dimension names (`logits_BRV`,
`n_B`, `cache_k_NBSGDh`): docs/rules.md, "Shape legend", is the one legend.
"""

from specjax import models
from specjax.engine import Engine, GenerateOutput

__all__ = ["Engine", "GenerateOutput", "models"]
