r"""Speculative decoding benchmark: methods x drafters against target-only decoding, interleaved.

For each prompt (batch 1, the latency setting of speculative decoding) the
binary runs target-only greedy, then every (drafter, method) configuration,
then target-only again; a configuration's speedup is its tokens/s over the mean
of the two baselines around it, and the drift between those baselines is
reported. Tokens/s are totals over the prompts. Optionally peers run beside it,
also interleaved, prompt by prompt: transformers (plain greedy, prompt lookup,
assisted generation) and llama.cpp's own binaries on the same GGUF files (plain
decode at the prompt's depth, llama-lookup, llama-speculative for model drafts;
see experiments/_llamacpp.py, built by scripts/build_llamacpp.sh). Prints a
Markdown table and writes a CSV.

    python experiments/benchmark.py                                  # SmolLM2, pld, 16 HumanEval prompts
    python experiments/benchmark.py --methods=exact,fly --fly=rule=reference,entropy=top3
    python experiments/benchmark.py --model=qwen2.5-coder-1.5b-instruct \
        --drafts=qwen2.5-coder-0.5b-instruct --num_prompts=4 --max_new_tokens=64 --peer=transformers
    python experiments/benchmark.py --methods=fly,fly-published --num_prompts=8 --stop_at_eos=false \
        --peer=llamacpp --llamacpp_dir ~/.cache/specjax/llama.cpp/bin
"""

from __future__ import annotations

import csv
import dataclasses
import os
import statistics
import sys
import time

from absl import app, flags, logging

from experiments import _common as C
from experiments import _llamacpp, _paths

_MODEL = flags.DEFINE_string("model", "smollm2-135m-instruct", "Target: preset, .gguf or HF directory.")
_DRAFTS = flags.DEFINE_list("drafts", ["pld"], "Drafters: pld, self:N, a preset/path (draft model), "
                            "or pld+<preset/path> (FLy's multi-level).")
_METHODS = flags.DEFINE_list("methods", ["exact", "fly", "fly-published", "asd", "csd", "typical"],
                            "Verification methods; fly-published is fly with rule=reference, entropy=top3 "
                            "(docs/rules.md: the published code's behaviour).")
PUBLISHED_FLY = {"rule": "reference", "entropy": "top3"}
_K = flags.DEFINE_integer("k", 8, "Draft tokens per round.")
_NEW = flags.DEFINE_integer("max_new_tokens", 128, "New tokens per prompt.")
_NUM = flags.DEFINE_integer("num_prompts", 16, "Prompts per dataset (the first N, in the dataset's order).")
_DATASETS = flags.DEFINE_list("datasets", ["humaneval"], "humaneval and/or mtbench.")
_CHAT_HE = flags.DEFINE_boolean("humaneval_chat", False, "HumanEval as a chat request (default: raw "
                                "completion of the function prompt, HumanEval's own protocol).")
_EOS = flags.DEFINE_boolean("stop_at_eos", True, "Stop at EOS (False: exactly max_new_tokens per prompt).")
_TYPICAL_T = flags.DEFINE_float("typical_temperature", 0.7, "Temperature of the typical method (a T > 0 rule).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the sampling methods.")
_PEER = flags.DEFINE_list("peer", [], "Peers run beside specjax: transformers (greedy, prompt lookup, "
                          "assisted generation for model drafts) and/or llamacpp (llama-bench plain decode at "
                          "the prompt's depth, llama-lookup, llama-speculative for model drafts).")
_LLAMACPP_DIR = flags.DEFINE_string("llamacpp_dir", "", "Directory of llama.cpp's binaries (scripts/"
                                    "build_llamacpp.sh); empty: on PATH.")
_THREADS = flags.DEFINE_integer("llamacpp_threads", os.cpu_count() or 1, "llama.cpp's -t.")
_PLD_TOKENS = flags.DEFINE_integer("peer_pld_tokens", 10, "transformers' prompt_lookup_num_tokens.")
_CSV = flags.DEFINE_string("csv", "benchmark.csv", "Where to write the per-configuration rows.")
_BUCKET = flags.DEFINE_integer("prompt_bucket", 64, "Prompts are padded to a multiple of this many tokens "
                               "(Engine's prompt_bucket): one program per engine and bucket, compiled before "
                               "the timings.")
_LAYERS = flags.DEFINE_enum("layers", "stacked", ["stacked", "unrolled"], "Layer layout of every specjax "
                            "engine (Engine(layers=...); unrolled: one device, longer compiles).")
_MATMUL = flags.DEFINE_list("matmul", ["auto"], "Matmul paths of the specjax engines (Engine(matmul=...): auto, "
                            "native, q8, xla; auto: the native CPU kernel on one CPU device). Several: every "
                            "engine for each, interleaved in one run; the first is the target-only baseline's.")
_MESH = flags.DEFINE_string("mesh", "", "DATA,MODEL: run every engine on a jax.make_mesh((DATA, MODEL), "
                            "('data', 'model')) mesh (batch 1: DATA must be 1); empty: one device. The "
                            "per-device bytes of parameters and caches are printed either way.")
_OPTIONS = {m: flags.DEFINE_string(m, "", f"Options of {m} as key=value,key=value (e.g. theta=0.3).")
            for m in ("fly", "asd", "csd", "typical")}


@dataclasses.dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    stats: list = dataclasses.field(default_factory=list)  # per generate call, merged by specjax.metrics
    diverged: int = 0

    def add(self, out_tokens, seconds, stats=None):
        self.tokens += sum(len(t) for t in out_tokens)
        self.seconds += seconds
        if stats:
            self.stats.append(stats)

    @property
    def tps(self):
        return self.tokens / self.seconds if self.seconds else 0.0


def parse_options(method: str, text: str) -> dict:
    """--fly=theta=0.3,window=6 -> {"theta": 0.3, "window": 6}, typed by the rule object's fields."""
    _, options = C.parse_method_spec(f"{method}:{text}")
    if {"draft", "k"} & set(options):
        raise app.UsageError(f"--{method}: draft and k are set by --drafts and --k, not per method")
    return options


def main(argv):
    C.check_output("csv", _CSV.value)  # before any work
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {' '.join(argv[1:])}")
    logging.set_verbosity(logging.WARNING)
    import specjax
    from specjax import metrics, models
    from experiments import data

    for name in (_K, _NEW, _NUM, _BUCKET):
        if name.value <= 0:
            raise app.UsageError(f"--{name.name} must be positive")
    bad = sorted(set(_MATMUL.value) - {"auto", "native", "q8", "xla"}) or (
        ["(repeated)"] if len(set(_MATMUL.value)) < len(_MATMUL.value) else []) or ([] if _MATMUL.value else ["(none)"])
    if bad:
        raise app.UsageError(f"--matmul: {', '.join(bad)}; give one or more of auto, native, q8, xla")
    matmuls = _MATMUL.value
    unknown = sorted(set(_METHODS.value) - {"exact", "greedy", "fly", "fly-published", "asd", "csd", "typical",
                                            "sampling"})
    if unknown:
        raise app.UsageError(f"unknown method(s): {', '.join(unknown)}")
    options = {m: parse_options(m, f.value) for m, f in _OPTIONS.items()}
    llama_peer = make_llamacpp_peer(_PEER.value, _MODEL.value, _DRAFTS.value)  # before any loading
    mesh = make_mesh(_MESH.value)
    if mesh is not None and _LAYERS.value == "unrolled":
        raise app.UsageError("--layers=unrolled runs on one device; drop --mesh or use --layers=stacked")
    started = time.perf_counter()
    target = models.load(_MODEL.value)
    tok = target.tokenizer
    prompts = []
    for dataset in _DATASETS.value:
        if dataset == "humaneval" and not _CHAT_HE.value:
            prompts += [("humaneval", tok.encode(p["prompt"])) for p in data.humaneval_problems(_NUM.value)]
        else:
            prompts += [(dataset, tok.chat_prompt_ids(m)) for m in data.messages(dataset, _NUM.value)]
    if llama_peer:
        _log(f"llama.cpp peer: {', '.join(llama_peer)}; prompt depths {[len(ids) for _, ids in prompts]}")
    eos = None if _EOS.value else ()
    baseline = specjax.Engine(target, max_new_tokens=_NEW.value, eos_ids=eos, mesh=mesh, layers=_LAYERS.value,
                              matmul=matmuls[0], prompt_bucket=_BUCKET.value)
    configs = {}  # (drafter, method, matmul) -> engine; drafter "none": target-only with another matmul
    for matmul in matmuls[1:]:
        configs[("none", "target-only", matmul)] = specjax.Engine(
            target, max_new_tokens=_NEW.value, eos_ids=eos, mesh=mesh, layers=_LAYERS.value, matmul=matmul,
            prompt_bucket=_BUCKET.value)
    for spec in _DRAFTS.value:
        draft, label = C.resolve_draft(spec, _MODEL.value), spec
        for method in _METHODS.value:
            T = _TYPICAL_T.value if method == "typical" else 0.0
            rule, opts = method, options.get(method, {})
            if method == "fly-published":
                rule, opts = "fly", {**options["fly"], **PUBLISHED_FLY}
            for matmul in matmuls:
                configs[(label, method, matmul)] = specjax.Engine(
                    target, draft=draft, method=rule, k=_K.value, max_new_tokens=_NEW.value, temperature=T,
                    seed=_SEED.value, eos_ids=eos, mesh=mesh, prompt_bucket=_BUCKET.value, layers=_LAYERS.value,
                    matmul=matmul, **opts)

    peer = _make_peer(target, _DRAFTS.value) if "transformers" in _PEER.value else {}
    _log(f"compiling {1 + len(configs)} programs over {len(prompts)} prompts ...")
    buckets = {}
    for _, ids in prompts:  # compile each prompt-length bucket once, outside the timings
        buckets.setdefault(-(-len(ids) // _BUCKET.value), ids)
    for ids in buckets.values():
        for engine in [baseline, *configs.values()]:
            engine.generate([ids])
    _log("measuring ...")
    base, tallies, drift = Tally(), {key: Tally() for key in configs}, []
    peer_tallies = {name: Tally() for name in peer}
    llama_tallies = {name: Tally() for name in llama_peer}
    for i, (dataset, ids) in enumerate(prompts):
        _paths.set_status(lambda i=i: f"stopped measuring prompt {i + 1}/{len(prompts)}; the results are written "
                                      "only at the end, so the same command measures again")
        t = time.perf_counter()
        reference = baseline.generate([ids]).tokens
        first = time.perf_counter() - t
        references = {matmuls[0]: reference}  # each matmul's own target-only tokens
        for key, engine in configs.items():  # (another matmul's target-only comes before its methods)
            t = time.perf_counter()
            out = engine.generate([ids])
            tallies[key].add(out.tokens, time.perf_counter() - t, out.stats)
            if key[0] == "none":
                references[key[2]] = out.tokens
            tallies[key].diverged += out.tokens != (reference if key[0] == "none" else references[key[2]])
        for name, run in peer.items():
            t = time.perf_counter()
            n = run(ids)
            peer_tallies[name].add([[0] * n], time.perf_counter() - t)
        for name, run in llama_peer.items():  # timed by llama.cpp itself (generation only)
            r = run(ids, tok.decode(ids))
            llama_tallies[name].add([[0] * r.tokens], r.seconds)
            if r.drafted is not None:
                llama_tallies[name].stats.append((r.drafted, r.accepted))
        t = time.perf_counter()
        baseline.generate([ids])
        second = time.perf_counter() - t
        base.tokens += 2 * len(reference[0])  # two runs of the baseline around the methods
        base.seconds += first + second
        drift.append(second / first)
        _log(f"prompt {i + 1}/{len(prompts)} done ({time.perf_counter() - started:.0f}s elapsed)")

    rows = [dict(engine="specjax", drafter="none", method="target-only", tokens_per_s=base.tps, speedup=1.0,
                 tau=1.0, accepted_per_round=0.0, loose_share=0.0, divergence=0.0, matmul=matmuls[0])]
    for (label, method, matmul), tally in tallies.items():
        # (a target-only row of another matmul has no rounds: tau 1, nothing accepted or loose)
        merged = {"tau": 1.0, "accepted_per_round": 0.0, "loose_share": 0.0} if label == "none" else \
            metrics.merge(tally.stats)
        rows.append(dict(engine="specjax", drafter=label, method=method + (f"@T={_TYPICAL_T.value}" if method == "typical" else ""),
                         tokens_per_s=tally.tps, speedup=tally.tps / base.tps, tau=merged["tau"],
                         accepted_per_round=merged["accepted_per_round"], loose_share=merged["loose_share"],
                         divergence=tally.diverged / len(tally.stats), matmul=matmul))
    for name, tally in peer_tallies.items():
        rows.append(dict(engine="transformers", drafter=name.split(":")[0], method=name.split(":")[1],
                         tokens_per_s=tally.tps, speedup=tally.tps / base.tps, tau=float("nan"),
                         accepted_per_round=float("nan"), loose_share=float("nan"), divergence=float("nan")))
    for name, tally in llama_tallies.items():
        drafted = sum(d for d, _ in tally.stats)
        accepted = sum(a for _, a in tally.stats)
        rows.append(dict(engine="llama.cpp", drafter=name.split(":")[0], method=name.split(":")[1],
                         tokens_per_s=tally.tps, speedup=tally.tps / base.tps, tau=float("nan"),
                         accepted_per_round=float("nan"), loose_share=float("nan"), divergence=float("nan"),
                         llama_acceptance=accepted / drafted if drafted else float("nan")))
    print(f"\nmachine: {C.machine()}; load averages at the end {os.getloadavg()}")
    if llama_peer:
        print("llama.cpp rows: generation only, timed by llama.cpp (its prefill excluded; specjax's rows "
              f"include theirs); threads {_THREADS.value}; acceptance = accepted/drafted tokens")
    print(f"target {_MODEL.value}; {len(prompts)} prompts ({', '.join(_DATASETS.value)}"
          f"{', HumanEval as raw completion' if 'humaneval' in _DATASETS.value and not _CHAT_HE.value else ''}); "
          f"K={_K.value}; "
          f"max_new_tokens={_NEW.value}; stop_at_eos={_EOS.value}; batch 1; layers {_LAYERS.value}; options {options}")
    print(f"baseline drift (second/first run of each prompt): median {statistics.median(drift):.3f}, "
          f"range {min(drift):.3f}-{max(drift):.3f}; wall time {time.perf_counter() - started:.0f}s\n")
    print_memory(baseline, configs, max(len(ids) for _, ids in prompts) + _NEW.value + _K.value + 1)
    if len(matmuls) > 1:
        print(f"divergence: a method's against target-only decoding with the same matmul; another matmul's "
              f"target-only row's against the {matmuls[0]} baseline (q8 rows compute with int8 activations)\n")
    print("| engine | matmul | drafter | method | tokens/s | speedup vs specjax target-only | tau | accepted/round "
          "| loose share | divergence |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['engine']} | {r.get('matmul', '')} | {r['drafter']} | {r['method']} | {r['tokens_per_s']:.1f} "
              f"| {r['speedup']:.2f} | {r['tau']:.2f} | {r['accepted_per_round']:.2f} | {r['loose_share']:.2f} "
              f"| {r['divergence']:.2f} |")
    for r in rows:
        if "llama_acceptance" in r and r["llama_acceptance"] == r["llama_acceptance"]:  # not NaN
            print(f"llama.cpp {r['method']}: {r['llama_acceptance']:.1%} of drafted tokens accepted")
    if _CSV.value:
        with C.atomic_open(_CSV.value, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]) + ["llama_acceptance"], restval="")
            # (llama.cpp and transformers rows have no matmul: left empty)
            writer.writeheader()
            writer.writerows(rows)
        print(f"\nwrote {_CSV.value}")


def gguf_path(source: str) -> str:
    """The GGUF file of a preset or a .gguf path (what llama.cpp reads)."""
    from specjax import models

    if source in models.PRESETS:
        return str(models.presets.resolve(source))
    if source.endswith(".gguf"):
        return source
    raise app.UsageError(f"the llama.cpp peer reads GGUF files; {source!r} is neither a preset nor a .gguf file")


def make_llamacpp_peer(peers, model: str, drafts) -> dict:
    """{"drafter:method": run(ids, text) -> _llamacpp.Run} for --peer llamacpp, checked before anything
    loads: binaries missing -> a UsageError naming scripts/build_llamacpp.sh."""
    unknown = sorted(set(peers) - {"transformers", "llamacpp"})
    if unknown:
        raise app.UsageError(f"unknown --peer value(s): {', '.join(unknown)} (known: transformers, llamacpp)")
    if "llamacpp" not in peers:
        return {}
    model_drafts = [d[4:] if d.startswith("pld+") else d for d in drafts]
    model_drafts = [d for d in model_drafts if d != "pld" and not d.startswith("self:")]
    names = ["llama-bench", "llama-lookup"] + (["llama-speculative"] if model_drafts else [])
    peer = _llamacpp.Peer(_LLAMACPP_DIR.value or None, gguf_path(model), _NEW.value, _THREADS.value, _K.value,
                          ignore_eos=not _EOS.value)
    try:
        peer.check(names)
    except _llamacpp.MissingBinaryError as e:
        raise app.UsageError(str(e)) from None
    runs = {"none:target-only (llama-bench, depth = prompt)": lambda ids, text: peer.plain(len(ids)),
            f"pld:llama-lookup (K={_K.value})": lambda ids, text: peer.lookup(text)}
    for d in model_drafts:
        with_draft = dataclasses.replace(peer, draft_model=gguf_path(d))
        runs[f"{d}:llama-speculative (K={_K.value})"] = lambda ids, text, p=with_draft: p.speculative(text)
    return runs


def make_mesh(text: str):
    """"DATA,MODEL" -> a ("data", "model") mesh, or None for one device."""
    if not text:
        return None
    import jax

    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 2 or min(shape) < 1:
        raise app.UsageError(f"--mesh must be DATA,MODEL (two positive integers), got {text!r}")
    if shape[0] != 1:
        raise app.UsageError(f"--mesh {text}: the benchmark runs batch 1, so the data axis must be 1")
    if shape[0] * shape[1] > len(jax.devices()):
        raise app.UsageError(f"--mesh {text} needs {shape[0] * shape[1]} devices, {len(jax.devices())} present "
                             "(on a CPU: XLA_FLAGS=--xla_force_host_platform_device_count=N)")
    return jax.make_mesh(shape, ("data", "model"))


def print_memory(baseline, configs, max_len: int):
    """Bytes per device of parameters and KV caches, once per drafter (the method changes neither)."""
    from specjax import sharding

    engines = {"none": baseline}
    for (label, _, matmul), engine in configs.items():
        engines.setdefault(label if matmul == baseline.matmul else f"{label} ({matmul} matmul)", engine)
    print(f"memory per device (MB), batch 1, cache length {max_len}"
          f"{'; mesh ' + _MESH.value if _MESH.value else '; one device'}:")
    print("| drafter | target params | draft params | target cache | draft cache | total |")
    print("|---|---|---|---|---|---|")
    for label, engine in engines.items():
        r = sharding.memory_report(engine, 1, max_len)
        print(f"| {label} | " + " | ".join(f"{r.get(k, 0) / 2**20:.1f}" for k in
                                          ("target_params", "draft_params", "target_cache", "draft_cache", "total"))
              + " |")
    print()


def _make_peer(target, drafts):
    """transformers on the same GGUF files: greedy, prompt lookup, assisted generation."""
    import torch
    import transformers

    from specjax import models

    def load(preset):
        path = models.presets.resolve(preset)
        return transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                                 dtype=torch.float32).eval()

    hf_target = load(_MODEL.value)
    eos = target.tokenizer.eos_token_id

    def runner(**kwargs):
        def run(ids):
            batch = torch.tensor([ids])
            extra = {} if _EOS.value else dict(min_new_tokens=_NEW.value)
            with torch.inference_mode():
                out = hf_target.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=_NEW.value,
                                         do_sample=False, pad_token_id=eos, eos_token_id=eos, **extra, **kwargs)
            return out.shape[1] - len(ids)
        return run

    peer = {"none:target-only": runner(), f"pld:prompt-lookup({_PLD_TOKENS.value})":
            runner(prompt_lookup_num_tokens=_PLD_TOKENS.value)}
    for spec in drafts:
        name = spec[4:] if spec.startswith("pld+") else spec
        if name in models.PRESETS:
            peer[f"{name}:assisted"] = runner(assistant_model=load(name))
    return peer


def _log(msg):
    print(f"[benchmark] {msg}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    C.run_main(main)
