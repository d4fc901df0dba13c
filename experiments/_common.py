"""What the experiment binaries share, one module per job, gathered under one name (`C`):

    _cli                log lines, a ticker for long calls, the machine's description
    _models             models and drafts from --model / --draft specs (random:tiny for tests)
    _prompts            prompts from flags, files and datasets
    _rule_flags         rule options as flags (the rule objects' fields), method specs, engines
    _calibration_files  CSD memory directories and ASD calibration JSON
    _runs               an engine over many prompts, compiled first, statistics merged
    _reports            differences from target-only output, Pareto fronts, CSV and JSON
    _paths              output paths checked before any work, atomic writes, prompt exit on Ctrl-C
"""

from __future__ import annotations

from experiments._calibration_files import load_asd_calibration, load_csd_memory, save_csd_memory
from experiments._cli import Null, Ticker, cpu, log, machine
from experiments._models import RANDOM, byte_tokenizer, draft_model, load_model, random_tiny, resolve_draft
from experiments._prompts import DATASETS, define_prompt_flags, encode, read_prompts
from experiments._reports import divergence, first_difference, jsonable, pareto, write_csv
from experiments._rule_flags import (apply_calibration, define_calibration_flags,
                                     define_calibration_source_flags, define_rule_flags, make_engine,
                                     parse_method_spec, parse_option, rule_options, rule_options_from_flags,
                                     validate_calibration_source_flags)
from experiments._runs import Run, chunks, compile_for, run
from experiments._paths import atomic_open, check_output, write_text
from experiments._paths import run as run_main
from experiments import _prompts, _rule_flags

# the modules that define the shared flags: a binary adopts them so that --help lists them
FLAG_MODULES = (_prompts, _rule_flags)

__all__ = [
    "DATASETS", "RANDOM", "Null", "Run", "Ticker", "apply_calibration", "byte_tokenizer", "chunks", "compile_for", "cpu",
    "define_calibration_flags", "define_calibration_source_flags", "define_prompt_flags", "define_rule_flags", "divergence",
    "FLAG_MODULES", "atomic_open", "check_output", "draft_model", "encode", "first_difference", "jsonable", "load_asd_calibration", "load_csd_memory",
    "load_model", "log", "machine", "make_engine", "pareto", "parse_method_spec", "parse_option", "random_tiny",
    "read_prompts", "resolve_draft", "rule_options", "rule_options_from_flags", "run", "run_main", "save_csd_memory",
    "validate_calibration_source_flags", "write_csv", "write_text",
]
