"""Target-only generation: the baseline loop against a plain re-scoring loop."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import specjax
from specjax.models import Config, random_model

TINY = Config(vocab_size=97, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
              num_kv_heads=2, head_dim=8, rope_theta=500.0)
PROMPTS = [[5, 6, 7, 8, 9], [11], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8]]


@pytest.fixture(scope="module")
def tiny():
    return random_model(TINY, seed=7)


def naive_greedy(model, prompt, n):
    """Re-scores the whole sequence for every token: no cache, no batching."""
    seq = np.asarray(prompt)
    buf = np.zeros((1, len(prompt) + n), np.int32)
    out = []
    for _ in range(n):  # fixed-length buffer: one compile; causal attention ignores the padding
        buf[0, : len(seq)] = seq
        token = int(np.argmax(np.asarray(model.logits(buf))[0, len(seq) - 1]))
        out.append(token)
        seq = np.append(seq, token)
    return out


def test_greedy_matches_naive_loop_on_a_ragged_batch(tiny):
    out = specjax.Engine(tiny, max_new_tokens=12).generate(PROMPTS)
    for prompt, tokens in zip(PROMPTS, out.tokens):
        assert tokens == naive_greedy(tiny, prompt, 12)
    assert out.stats["tau"] == 1.0 and out.stats["rounds_per_request"] == [11, 11, 11]


def test_batch_equals_one_at_a_time(tiny):
    engine = specjax.Engine(tiny, max_new_tokens=9)
    batched = engine.generate(PROMPTS).tokens
    assert batched == [engine.generate([p]).tokens[0] for p in PROMPTS]


def test_eos_stops_each_row_and_is_included(tiny):
    free = specjax.Engine(tiny, max_new_tokens=12).generate(PROMPTS).tokens
    eos = free[0][3]
    with_eos = dataclasses.replace(tiny, config=dataclasses.replace(TINY, eos_token_ids=(eos,)))
    out = specjax.Engine(with_eos, max_new_tokens=12).generate(PROMPTS)
    for full, cut in zip(free, out.tokens):
        expected = full[: full.index(eos) + 1] if eos in full else full
        assert cut == expected
    first = free[0].index(eos)
    assert out.tokens[0][-1] == eos and len(out.tokens[0]) == first + 1
    # tau counts only the tokens each round kept (the prefill token is no round's)
    assert out.stats["round_tokens_per_request"][0] == first == out.stats["rounds_per_request"][0]


def test_max_new_tokens_one_runs_no_round(tiny):
    out = specjax.Engine(tiny, max_new_tokens=1).generate(PROMPTS)
    assert [len(t) for t in out.tokens] == [1, 1, 1]
    assert out.stats["rounds"] == 0


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(tiny):
    greedy = specjax.Engine(tiny, max_new_tokens=8).generate(PROMPTS).tokens
    a = specjax.Engine(tiny, max_new_tokens=8, temperature=1.0, seed=1).generate(PROMPTS).tokens
    b = specjax.Engine(tiny, max_new_tokens=8, temperature=1.0, seed=1).generate(PROMPTS).tokens
    c = specjax.Engine(tiny, max_new_tokens=8, temperature=1.0, seed=2).generate(PROMPTS).tokens
    assert a == b and a != c
    nucleus = specjax.Engine(tiny, max_new_tokens=8, temperature=1.0, top_p=1e-6, seed=3).generate(PROMPTS)
    assert nucleus.tokens == greedy


def test_one_compiled_program_without_host_callbacks(tiny):
    text = specjax.Engine(tiny, max_new_tokens=5).lower(PROMPTS).as_text()
    assert "stablehlo.while" in text
    assert "callback" not in text.lower()


@pytest.mark.parametrize("prompts, match", [
    ([], "non-empty list"),
    ([[]], "prompt 0 must be a non-empty"),
    ([[1, 2], [1, 97]], "prompt 1 has token ids outside the vocabulary"),
    ("hello", "non-empty list of token-id lists"),
])
def test_bad_prompts(tiny, prompts, match):
    with pytest.raises(ValueError, match=match):
        specjax.Engine(tiny, max_new_tokens=4).generate(prompts)


def test_prompt_longer_than_the_cache(tiny):
    with pytest.raises(ValueError, match="does not fit the cache.*max_len 16"):
        specjax.Engine(tiny, max_new_tokens=4, max_len=16).generate([list(range(1, 20))])


@pytest.mark.parametrize("kwargs, match", [
    (dict(max_new_tokens=0), "max_new_tokens must be a positive integer"),
    (dict(max_new_tokens=-3), "max_new_tokens must be a positive integer"),
    (dict(k=0), "k must be an integer >= 1"),
    (dict(method="nope"), "unknown method 'nope'"),
    (dict(top_p=0.0), "top_p"),
    (dict(temperature=-1.0), "temperature"),
    (dict(layers="flat"), "layers must be 'stacked' or 'unrolled'"),
])
def test_bad_settings(tiny, kwargs, match):
    with pytest.raises(ValueError, match=match):
        specjax.Engine(tiny, **kwargs)


@pytest.mark.heavy
@pytest.mark.parity
@pytest.mark.smollm2
@pytest.mark.slow
def test_smollm2_greedy_matches_transformers(smollm2):
    """Real model: our compiled loop against transformers' greedy generate on the same GGUF."""
    import torch
    import transformers

    path = specjax.models.presets.resolve("smollm2-135m-instruct")
    ref = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                            dtype=torch.float32).eval()
    tok = smollm2.tokenizer
    prompts = [tok.chat_prompt_ids("Write a haiku about the sea."),
               tok.chat_prompt_ids("What is 17 times 23? Answer briefly.")]
    out = specjax.Engine(smollm2, max_new_tokens=24).generate(prompts)
    for prompt, ours in zip(prompts, out.tokens):
        with torch.no_grad():
            gen = ref.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                               eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
        theirs = gen[0, len(prompt):].tolist()
        if ours != theirs:  # only a near-tie may flip; show it
            i = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            with torch.no_grad():
                logits = ref(torch.tensor([prompt + theirs[:i]])).logits[0, -1].numpy()
            top2 = np.sort(logits)[-2:]
            assert top2[1] - top2[0] < 1e-4, f"diverged at {i} with a top-2 gap of {top2[1] - top2[0]}"
        assert len(ours) > 0 and tok.decode(ours).strip()


def test_prompt_widths_form_a_geometric_ladder():
    from specjax.engine import prompt_width

    widths = {n: prompt_width(n) for n in range(1, 1025)}
    assert all(w >= n for n, w in widths.items())
    assert all(w <= max(16, n + 15) if n <= 64 else w < 1.5 * n for n, w in widths.items())  # padding under half
    assert sorted({widths[n] for n in range(20, 401)}) == [32, 48, 64, 96, 128, 192, 256, 384, 512]
    assert prompt_width(20, 16) == 32 and prompt_width(129, 128) == 256  # an explicit bucket: its multiples


def test_target_only_takes_the_greedy_rule_object(tiny):
    from specjax import verify

    by_object = specjax.Engine(tiny, method=verify.Greedy(), max_new_tokens=5)
    assert by_object.rule is None and by_object.method == "greedy"
    assert by_object.generate(PROMPTS).tokens == specjax.Engine(tiny, max_new_tokens=5).generate(PROMPTS).tokens
    with pytest.raises(ValueError, match="method 'fly' needs a draft"):
        specjax.Engine(tiny, method=verify.Fly(), max_new_tokens=5)


def _quantized_layers(model):
    """`model` with its MLP matrices block-quantized (Q8_0 codes of the same float values)."""
    import gguf

    from specjax.models import quant

    layers = dict(model.params["layers"])
    for name in ("w_gate", "w_up"):
        w = np.asarray(layers[name])  # [N, D, F]; GGUF blocks run along D
        blocks = [quant.extract_codes(gguf.quants.quantize(np.ascontiguousarray(w[i].T), gguf.GGMLQuantizationType.Q8_0),
                                      gguf.GGMLQuantizationType.Q8_0).as_linear(w.shape[1:]) for i in range(w.shape[0])]
        layers[name] = quant.stack_layers(blocks)
    return model.with_params({**model.params, "layers": layers})


@pytest.mark.parametrize("draft, method", [(None, "greedy"), pytest.param("pld", "fly", marks=pytest.mark.heavy),
                                           pytest.param("model", "exact", marks=pytest.mark.heavy)])
def test_unrolled_layers_give_the_stacked_tokens(tiny, draft, method):
    """layers="unrolled": the same tokens and statistics, block-quantized layers read as float arrays."""
    from specjax.models import llama, quant

    target = _quantized_layers(tiny)
    draft = random_model(dataclasses.replace(TINY, num_layers=1), seed=3) if draft == "model" else draft
    # fixed K: adaptive engines would each weigh widths against their own measured costs
    settings = dict(draft=draft, method=method, k=3, max_new_tokens=6, eos_ids=(), adaptive=False)
    stacked = specjax.Engine(target, **settings)
    unrolled = specjax.Engine(target, **settings, layers="unrolled")
    params = unrolled.params.target
    assert llama.is_unrolled(params) and "layers" not in params and "layer_1" in params
    assert not any(isinstance(x, quant.BlockQuant) for x in jax.tree.leaves(
        params, is_leaf=lambda x: isinstance(x, quant.BlockQuant)))
    a, b = stacked.generate(PROMPTS), unrolled.generate(PROMPTS)
    assert a.tokens == b.tokens and a.stats == b.stats
    logits = llama.forward(TINY, params, jnp.asarray([PROMPTS[0]]))
    # the same weights' values; XLA fuses a loop of layers differently from a scan (an ulp or so)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(target.logits([PROMPTS[0]])), rtol=1e-5, atol=1e-6)
    assert llama.unstack_layers(params) is params  # already unrolled


def test_unrolled_layers_need_one_device(tiny):
    mesh = jax.make_mesh((1, 1), ("data", "model"))
    with pytest.raises(ValueError, match="runs on one device"):
        specjax.Engine(tiny, layers="unrolled", mesh=mesh)
