"""The host re-tokenizing reference (experiments/_cross_vocab_host.py), FLy's way of drafting with another
vocabulary: on the tiny pair of random models with two byte-level tokenizers."""

from __future__ import annotations

import pytest

import specjax
from experiments._cross_vocab_host import HostReference, _common_prefix
from test_cross_draft import TEXTS, pair  # noqa: F401  (the fixture)


def test_exact_is_target_only_and_the_random_draft_is_run(pair):  # noqa: F811
    target, draft = pair
    new = 12
    want = specjax.Engine(target, max_new_tokens=new, eos_ids=()).generate(
        [target.tokenizer.encode(t) for t in TEXTS]).tokens
    for method in ("exact", "fly"):
        engine = specjax.Engine(target, draft="pld", method=method, k=3, max_new_tokens=new, eos_ids=())
        host = HostReference(engine, draft, k=3)
        for text, expected in zip(TEXTS, want):
            got, rounds = host.generate(target.tokenizer.encode(text), draft.tokenizer.encode(text), new)
            assert len(got) == new and 1 <= rounds <= new - 1
            assert host._d_cached  # the draft ran: its context and proposals are cached
            if method == "exact":
                assert got == expected


class Oracle(HostReference):
    """Proposes the target's own greedy continuation, its text sent through the draft's tokenizer and
    back (what a perfect draft of another vocabulary would propose)."""

    continuation: list[int] = []
    round_trip = True  # False: the continuation's own ids

    def propose(self, out, draft_prompt_ids, max_new_tokens):
        ids = self.continuation[len(out):len(out) + self.k]
        if not self.round_trip:
            return ids
        return self.t_tok.encode(self.d_tok.decode(self.d_tok.encode(self.t_tok.decode(ids))))[:self.k]


def test_an_oracle_draft_is_accepted_and_the_commit_stays_exact(pair):  # noqa: F811
    target, draft = pair
    new, k = 14, 3
    engine = specjax.Engine(target, draft="pld", method="exact", k=k, max_new_tokens=new, eos_ids=())
    oracle = Oracle(engine, draft, k=k)
    for text in TEXTS:
        ids = target.tokenizer.encode(text)
        want = specjax.Engine(target, max_new_tokens=new, eos_ids=()).generate([ids]).tokens[0]
        oracle.continuation = want
        oracle.round_trip = False  # every draft right: K + 1 tokens a round
        assert oracle.generate(ids, [], new) == (want, -(-(new - 1) // (k + 1)))
        oracle.round_trip = True  # the text re-tokenized may split otherwise than the target chose: fewer kept
        got, rounds = oracle.generate(ids, [], new)
        assert got == want and rounds < new - 1


def test_a_sampling_engine_is_refused(pair):  # noqa: F811
    target, draft = pair
    engine = specjax.Engine(target, draft="pld", method="exact", k=3, temperature=1.0)
    with pytest.raises(ValueError, match="greedy"):
        HostReference(engine, draft, k=3)


class Verbatim(Oracle):
    """Proposes fixed ids (an EOS among them), and a rule that accepts every draft."""

    def __init__(self, *args, proposal=(), **kwargs):
        super().__init__(*args, **kwargs)
        import numpy as np
        from specjax import verify

        self.fixed = list(proposal)
        self._verify = lambda state, drafts, logits, num_draft, key: (  # accept all k, then token 7
            verify.Verdict(np.asarray(num_draft), np.array([7]), np.array([0])), state, None)

    def propose(self, out, draft_prompt_ids, max_new_tokens):
        return self.fixed


def test_an_accepted_eos_ends_the_reply_and_its_rounds(pair):  # noqa: F811
    target, draft = pair
    eos = 5
    engine = specjax.Engine(target, draft="pld", method="exact", k=3, max_new_tokens=20, eos_ids=(eos,))
    host = Verbatim(engine, draft, k=3, proposal=[9, eos, 9])
    got, rounds = host.generate(target.tokenizer.encode(TEXTS[0]), [], 20)
    # the first token from the prefill, then one round: [9, EOS] kept, the rest of it dropped
    assert got[1:] == [9, eos] and rounds == 1
    host.fixed = [9, 9, 9]  # no EOS: rounds of 4 tokens until max_new_tokens
    got, rounds = host.generate(target.tokenizer.encode(TEXTS[0]), [], 20)
    assert len(got) == 20 and eos not in got[1:] and rounds == 5


def test_common_prefix():
    assert _common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert _common_prefix([], [1]) == 0 and _common_prefix([1, 2], [1, 2]) == 2


def test_the_table_binary_rows_and_table():
    from experiments import _cross_vocab_rows as R

    # per prompt: each K and rule, every drafter but transformers (run apart) and a "same" draft that is the target
    got = R.configs([8], ["exact"], "q1.5", "q0.5")
    assert got == [("cross", "exact", 8), ("host", "exact", 8), ("same", "exact", 8), ("pld", "exact", 8)]
    assert ("same", "exact", 8) not in R.configs([8], ["exact"], "q0.5", "q0.5")

    def line(index, drafter, tau, rounds, tps, equal=True, tokens=0):
        out = dict(target="q", max_new_tokens=16, dataset="humaneval", index=index, k=8 if drafter else 0,
                   method="exact", drafter=drafter or "none", config=R.label(drafter, "exact", 8) if drafter
                   else "target-only", tau=tau, rounds=rounds, tokens_per_s=tps, equals_target_only=equal)
        if drafter == "transformers":  # tokens / tau forward calls
            del out["tokens_per_s"], out["rounds"]
            out["tokens"] = tokens
        return out

    lines = [line(i, None, 1.0, 15, 10.0) for i in range(2)]
    lines += [line(0, "cross", 3.0, 5, 20.0), line(1, "cross", 1.0, 15, 8.0, equal=False),  # tau (15 + 15) / 20
              line(0, "host", 2.0, 8, 5.0), line(1, "host", 2.0, 8, 5.0),
              line(0, "transformers", 2.5, 0, 0, tokens=20), line(1, "transformers", 1.5, 0, 0, tokens=15)]
    assert len({R.key(l) for l in lines}) == len(lines)

    def rows_of(text):
        return {r.split("|")[3].strip(): [c.strip() for c in r.split("|")[1:-1]] for r in text.splitlines()[2:]}

    rows = rows_of(R.table(lines, "q"))
    assert rows["cross"][4:7] == ["1.50", "1.40x", "1/2"]  # pooled tau; median of 2.0x and 0.8x; one output differs
    # transformers pooled like the others: 35 tokens / (8 + 10) calls, not the mean of 2.5 and 1.5
    assert rows["host"][4] == "2.00" and rows["transformers"][4] == "1.94" and rows["transformers"][5] == "-"
    assert rows["host"][7] == "0.75" and rows["transformers"][7] == "0.77" and rows["cross"][7] == ""
    assert "**0.75**" in rows["**on-device / best yardstick**"][7]  # against host, the better yardstick

    # a prompt a yardstick lacks (transformers failed on it) is left out of both sides of its ratio
    rows = rows_of(R.table([l for l in lines if (l["drafter"], l["index"]) != ("transformers", 1)], "q"))
    assert rows["transformers"][3:5] == ["1", "2.50"] and rows["transformers"][7] == "1.20"  # 3.0 / 2.5
    assert "**0.75**" in rows["**on-device / best yardstick**"][7]

    # prompts measured on two machines: one median of tokens/s ratios per machine, each prompt against
    # the target-only line of its own machine
    for l in lines:
        l["machine"] = "AMD EPYC, 2 cores" if l["index"] == 0 else "Intel Xeon, 2 cores"
    rows = rows_of(R.table(lines, "q"))
    assert rows["cross"][5] == "2.00x (AMD EPYC, 1); 0.80x (Intel Xeon, 1)" and rows["cross"][4] == "1.50"


def test_the_table_heads_with_the_command_of_its_ledger():
    from experiments import _cross_vocab_rows as R

    defaults = {"targets": "a,b", "ks": "8,15", "max_new_tokens": 128, "num_humaneval": 40, "num_mtbench": 40}
    lines = [dict(dataset=d, index=i, drafter=r) for d, i, r in
             [("humaneval", 0, "cross"), ("humaneval", 1, "cross"), ("mtbench", 0, "pld"), ("humaneval", 1, "pld")]]
    got = R.command(lines, dict(defaults, targets="b", num_humaneval=0, num_mtbench=0), defaults, "out")
    # the ledger's prompt counts, not the regenerating call's zeros; no transformers lines: --notransformers
    assert got == ("python experiments/cross_vocab_table.py --targets=b --num_humaneval=2 --num_mtbench=1 "
                   "--notransformers --output_dir out")
    full = [dict(dataset=d, index=i, drafter="transformers") for d in ("humaneval", "mtbench") for i in range(40)]
    assert R.command(full, defaults, defaults, "out") == "python experiments/cross_vocab_table.py --output_dir out"


def test_the_table_names_each_machine_per_target():
    from experiments import _cross_vocab_rows as R

    def line(target, machine, date):
        return dict(target=target, machine=machine, date=date)

    lines = [line("q1.5", "AMD", "2026-12-05"), line("q1.5", "AMD", "2026-12-06"), line("q1.5", "Intel", "2026-12-07"),
             line("q0.5", "Intel", "2026-12-07")]
    assert R.where(lines, "q1.5") == "AMD (2026-12-05 to 2026-12-06, 2 lines); Intel (2026-12-07, 1 line)"
    assert R.where(lines, "q0.5") == "Intel (2026-12-07, 1 line)"
    assert R.where(lines, "q3") == "nothing yet"
