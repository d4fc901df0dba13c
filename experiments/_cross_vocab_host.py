"""The yardsticks for drafting with another vocabulary: FLy's way on the host, and transformers'.

`HostReference` is speculative decoding as FLy's published code does it for a draft of another model
family: every round, on the host, the text the target has committed is re-tokenized with the draft's
tokenizer, the draft proposes K tokens, their text is tokenized with the target's tokenizer (the first
K ids kept), and the target verifies them with the engine's own rule. It is not in the library: it
needs the host every round, which is what `specjax.cross_draft` avoids (tables on the device, one
compiled loop). It is here to measure what that costs in acceptance (tau), on the same models,
prompts and rule.

Exactly, per round:

- draft context = the draft's own prompt ids (its chat template) + draft_tok.encode(target_tok.decode(
  the target's new tokens so far)); the draft's KV cache keeps the longest prefix it shares with the
  previous round's context (its proposals included) and is fed the rest;
- the draft decodes K tokens greedily (stopping after one of its EOS ids);
- proposal = target_tok.encode(draft_tok.decode(those K ids))[:K], after dropping a trailing partial
  UTF-8 character (decoded as U+FFFD);
- the target scores [pending, proposal] in one forward at K + 1 positions, and `engine.rule` (exact or
  FLy, with the engine's options) decides; the round emits the accepted drafts and the next token;
- the reply ends at the target's first EOS id, accepted draft or next token (the rounds counted end
  with the round that emitted it).

`transformers_tau`: transformers' assisted generation with `assistant_tokenizer=` (its universal
assisted decoding, which also re-tokenizes text every round), greedy, a constant K; its tau counts the
target's forward calls. One fix to transformers (5.x) while it runs: the rollback of the assistant's KV
cache (see `_uag_cache_fix`).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import numpy as np

_FEED_BUCKETS = (1, 16, 64, 256, 1024, 4096)  # 1: a draft step feeds one token


def _bucket(n: int) -> int:
    return next((b for b in _FEED_BUCKETS if b >= n), -(-n // 4096) * 4096)


class HostReference:
    """Speculative decoding with a draft of another vocabulary, re-tokenizing on the host every round.

    engine: a `specjax.Engine` of the target with method "exact" or a loose rule and no drafter needed
    (its target, rule, backend and EOS ids are used; batch 1, greedy). draft: a `specjax.models.Model`.
    """

    def __init__(self, engine, draft, k: int):
        import functools

        import jax

        from specjax.models import llama

        if engine.temperature != 0.0:
            raise ValueError("the host reference is greedy: build the engine with temperature=0")
        from specjax import native

        self.engine, self.draft, self.k = engine, draft, int(k)
        self.t_tok, self.d_tok = engine.target.tokenizer, draft.tokenizer
        # both models run as the engine runs them: its (packed) target params and its kernels, the
        # draft's params packed the same way, so that the speed compared is the host loop's alone
        self.t_params = engine.params.target
        self.d_params = draft.params if engine.backend.matmul == "xla" else native.pack_params(
            draft.params, draft.dtype, engine.backend.matmul == "q8")
        self.d_eos = set(int(e) for e in draft.eos_token_ids)

        def at(model, backend):
            @functools.partial(jax.jit, static_argnames=())
            def run(params, tokens_1T, cache, last):
                logits, cache = llama.forward_cached(model.config, params, tokens_1T, cache, dtype=model.dtype,
                                                     select_BJ=last[None, None], backend=backend)
                return logits[0, 0], cache
            return run

        self._t_last = at(engine.target, engine.backend)
        self._d_last = at(draft, engine.backend)

        @jax.jit
        def score(params, tokens_1R, cache):
            return llama.forward_cached(engine.target.config, params, tokens_1R, cache, dtype=engine.target.dtype,
                                        backend=engine.backend)
        self._t_score = score

        @jax.jit
        def verify(rule_state, drafts_1K, logits_1RV, num_draft_1, key):
            return engine.rule(rule_state, drafts_1K, logits_1RV, num_draft_B=num_draft_1, key=key,
                               active_B=jax.numpy.array([True]), draft_probs_BKV=None, temperature=0.0,
                               backend=engine.backend)
        self._verify = verify

    def compiled(self) -> int:
        """How many programs its jitted steps have traced (it grows when a call compiles one)."""
        return sum(f._cache_size() for f in (self._t_last, self._d_last, self._t_score, self._verify))

    def generate(self, prompt_ids: Sequence[int], draft_prompt_ids: Sequence[int], max_new_tokens: int):
        """(the target's new token ids, the number of rounds: the target's verifying forwards), batch 1."""
        import jax
        import jax.numpy as jnp

        from specjax.models import llama

        e, K = self.engine, self.k
        P = len(prompt_ids)
        S = _bucket(P) + max_new_tokens + K + 2
        t_cache = llama.init_cache(e.target.config, 1, S, e.target.dtype)
        first, t_cache = self._feed(self._t_last, self.t_params, t_cache, 0, list(prompt_ids))
        out = [int(jnp.argmax(first))]
        L = P  # the target's cached positions; out[-1] is pending
        self._d_cache, self._d_cached = None, []
        rule_state = e.rule.init_state(1)
        rounds = 0
        eos = set(e.eos_ids)
        while len(out) < max_new_tokens and out[-1] not in eos:
            proposal = self.propose(out, draft_prompt_ids, max_new_tokens)
            # the target verifies [pending, proposal] at K + 1 positions
            fed = np.zeros((1, K + 1), np.int32)
            fed[0, 0] = out[-1]
            fed[0, 1:1 + len(proposal)] = proposal
            logits_1RV, t_cache = self._t_score(self.t_params, fed, t_cache._replace(lengths=jnp.array([L], jnp.int32)))
            drafts = np.zeros((1, K), np.int32)
            drafts[0, :len(proposal)] = proposal
            verdict, rule_state, _ = self._verify(rule_state, drafts, logits_1RV,
                                                  np.array([len(proposal)], np.int32), jax.random.PRNGKey(rounds))
            n, nxt = int(verdict.num_accepted[0]), int(verdict.next_token[0])
            new = proposal[:n] + [nxt]
            out += new
            L += n + 1
            rounds += 1
            if any(t in eos for t in new):  # an EOS among the accepted drafts ends the reply, as in the engine
                break
        out = out[:max_new_tokens]
        if any(t in eos for t in out):
            out = out[:next(i for i, t in enumerate(out) if t in eos) + 1]
        return out, rounds

    def propose(self, out: list[int], draft_prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """The round's proposal in target ids (at most K), from the target's new tokens `out` so far:
        re-tokenized for the draft, K draft tokens, their text tokenized for the target."""
        import jax.numpy as jnp

        from specjax.models import llama

        K = self.k
        d_ctx = list(draft_prompt_ids) + self.d_tok.encode(self.t_tok.decode(out))
        if self._d_cache is None:
            self._d_cache = llama.init_cache(self.draft.config, 1, _bucket(len(d_ctx)) + 4 * max_new_tokens + 8 * K,
                                             self.draft.dtype)
        if len(d_ctx) + K + 1 > self._d_cache.k.shape[2]:
            raise ValueError("the draft's context outgrew its cache (its ids are many more than the target's)")
        keep = min(_common_prefix(self._d_cached, d_ctx), len(d_ctx) - 1)  # the cache's shared prefix
        logits, cache = self._feed(self._d_last, self.d_params, self._d_cache, keep, d_ctx[keep:])
        proposal_d, cached = [], d_ctx[:]
        while True:
            g = int(jnp.argmax(logits))
            proposal_d.append(g)
            if g in self.d_eos or len(proposal_d) == K:
                break
            logits, cache = self._feed(self._d_last, self.d_params, cache, len(cached), [g])
            cached.append(g)
        self._d_cache, self._d_cached = cache, cached
        text = self.d_tok.decode(proposal_d).rstrip("\ufffd")  # a character cut by the K-th token
        return self.t_tok.encode(text)[:K] if text else []

    def _feed(self, fn, params, cache, start: int, ids: list[int]):
        """Feeds `ids` at positions start.. (padded to a bucket: the padding's keys lie past the length
        pointer, overwritten later); the logits after the last one and the cache, its length moved."""
        import jax.numpy as jnp

        n = len(ids)
        tokens = np.zeros((1, _bucket(n)), np.int32)
        tokens[0, :n] = ids
        logits, cache = fn(params, tokens, cache._replace(lengths=jnp.array([start], jnp.int32)),
                           jnp.int32(n - 1))
        return logits, cache._replace(lengths=jnp.array([start + n], jnp.int32))


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@contextlib.contextmanager
def _uag_cache_fix():
    """Fixes the assistant's KV-cache rollback in transformers' universal assisted generation (5.x), for
    the calls made inside.

    The bug (transformers 5.25, generation/candidate_generator.py): since the cache's `crop(n)` removes n
    tokens (it used to keep n), `AssistedCandidateGenerator._update_past_and_masks` removes
    `self._last_ids_length - input_ids.shape[-1] + num_extra_tokens_to_remove` tokens, where
    `_last_ids_length` is the last round's sequence length; but
    `AssistedCandidateGeneratorDifferentTokenizers.get_candidates` sets `_last_ids_length` to a length in
    the TARGET's tokens (`input_ids.shape[-1]` or `new_target_ids.shape[-1]`) and passes the ASSISTANT's
    re-tokenized ids as `input_ids`. When the assistant's tokenizer needs more tokens than the target's
    (SmolLM2's for Qwen2.5's prompts: 175 for 167), the count is negative and nothing is removed: the
    assistant's cache keeps its rejected drafts (stale keys at positions that now hold other tokens) and
    outgrows its input, until `generate` is left no token to feed ("cannot reshape tensor of 0 elements
    into shape [1, 0, -1, 64]").

    The fix crops the cache to the longest prefix it shares with the round's assistant ids (at most all
    but the last, which `generate` feeds): what a correct cache holds, so the drafts are those of the
    same algorithm without a cache. Everything else (re-tokenizing, lookbehind windows, the alignment of
    old and new ids, the target's verification) is transformers' own."""
    from transformers.generation.candidate_generator import AssistedCandidateGeneratorDifferentTokenizers as UAG

    get_candidates, update = UAG.get_candidates, UAG._update_past_and_masks

    def patched_get_candidates(self, input_ids, **kwargs):
        out = get_candidates(self, input_ids, **kwargs)
        # the ids whose keys the cache holds (copied: transformers edits prev_assistant_ids in place)
        self._cached_assistant_ids = self.prev_assistant_ids[0].tolist()
        return out

    def patched_update(self, input_ids, num_extra_tokens_to_remove=0):
        cache = self.assistant_kwargs.get("cache", None)
        if cache is None:
            return False
        cached = self._cached_assistant_ids[:cache.get_seq_length()]
        keep = min(_common_prefix(cached, input_ids[0].tolist()), input_ids.shape[-1] - 1)
        if keep < len(cached):
            cache.crop(keep - len(cached))  # a negative count: the tokens to remove
        return True  # the attention mask and position ids: get_candidates drops them (the assistant's own)

    UAG.get_candidates, UAG._update_past_and_masks = patched_get_candidates, patched_update
    try:
        yield
    finally:
        UAG.get_candidates, UAG._update_past_and_masks = get_candidates, update


def transformers_tau(target_gguf, draft_gguf, k: int, max_new_tokens: int):
    """A function of one prompt (target ids) -> (the new ids, tau = new tokens / the target's forward
    calls) of transformers' assisted generation with a draft of another tokenizer, greedy, K constant;
    both models loaded once."""
    import pathlib

    import torch
    import transformers

    def load(path):
        path = pathlib.Path(path)
        model = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                  dtype=torch.float32).eval()
        tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        return model, tok

    target, t_tok = load(target_gguf)
    draft, d_tok = load(draft_gguf)
    draft.generation_config.num_assistant_tokens = k
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    draft.generation_config.assistant_confidence_threshold = 0.0
    calls = [0]
    target.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))

    def run(ids: Sequence[int]) -> tuple[list[int], float]:
        calls[0] = 0
        x = torch.tensor([list(ids)])
        with torch.no_grad(), _uag_cache_fix():
            y = target.generate(x, attention_mask=torch.ones_like(x), assistant_model=draft, tokenizer=t_tok,
                                assistant_tokenizer=d_tok, max_new_tokens=max_new_tokens, do_sample=False)
        new = y[0, x.shape[1]:].tolist()
        return new, len(new) / max(calls[0], 1)

    return run
