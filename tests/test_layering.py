"""The import graph of specjax/: no cycle, and no arrow from a lower layer to a higher one.

The graph is read with `ast` from every module's source: module-level imports and those inside
functions alike (a function-level import is an arrow too, only a later one); an import under
`if TYPE_CHECKING:` names a type for annotations and runs never, so it is no arrow. A
package's `__init__` is a node of its own.

The layers, lowest first (a module may import its own layer and the ones below):

    backend    the one settings object (`Backend`, plain data) and the file helpers every layer reads
    pallas     the kernels and their jnp references (the jnp twin of each kernel's own algebra)
    verify     the acceptance rules, pure functions over logits, and the primitives they share
               (`_common`: the plain statistics of a logits row, the token choice from logits
               that the loop and the drafters use too); they call a pallas kernel where the
               backend says "kernel"
    models     the decoder and its weights (config, quant, llama, conversion, checkpoints,
               tokenizer, the feature draft) and `_checks`, the input checks that Model.logits
               and the Engine share: it reads the rules' number checks, below it, so its arrow
               to verify points down
    native     the optional CPU kernels: their weight layouts subclass `quant.Relaid`; the models
               reach the kernels only through `Backend.kernels`, never by import
    sharding   logical-axis rules and layouts over a model's config and arrays (never the Model type)
    loader     `models.model` (the Model class and `models.load`) and the `specjax.models`
               package: loading with a mesh places the params through sharding, so the loader
               sits above it and the arrow between them goes one way
    drafters   what proposes tokens
    loop       the compiled program, its counters and the statistics of one call; and `metrics`,
               which merges the statistics of several calls on the host: it reads the loop's
               `Counters` and `statistics`, so it sits in the loop's layer, above them
    engine     the public Engine, the compilation cache, AOT reports, `specjax` itself
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "specjax"

LAYERS = [
    ("backend", ["specjax.backend", "specjax._files"]),
    ("pallas", ["specjax.pallas"]),
    ("verify", ["specjax.verify"]),
    ("models", ["specjax.models.config", "specjax.models.quant", "specjax.models.llama", "specjax.models.convert",
                "specjax.models.shards", "specjax.models.presets", "specjax.models.tokenizer",
                "specjax.models.catalog", "specjax.models.feature_draft", "specjax.models._param_cache",
                "specjax._checks"]),
    ("native", ["specjax.native"]),
    ("sharding", ["specjax.sharding"]),
    ("loader", ["specjax.models.model", "specjax.models"]),
    ("drafters", ["specjax.drafters", "specjax.pretokenize", "specjax.bpe", "specjax.vocab_bridge",
                  "specjax.cross_draft"]),
    ("loop", ["specjax.loop", "specjax.metrics"]),
    ("engine", ["specjax.engine", "specjax.costs", "specjax.compile_cache", "specjax.aot", "specjax"]),
]


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the specjax modules it imports (anywhere in its source)."""
    mods = modules()

    def owner(name: str) -> str:  # the module a dotted name lives in
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets = set()
        for node in _runtime_nodes(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names if a.name.split(".")[0] == "specjax"}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative: from the module's package up
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                if base.split(".")[0] != "specjax":
                    continue
                for a in node.names:  # `from specjax import verify` names a module; `from x import f` does not
                    full = f"{base}.{a.name}"
                    targets.add(full if full in mods else owner(base))
        graph[name] = targets - {name, ""}
    return graph


def _runtime_nodes(tree):
    """Every node of `tree` but those under `if TYPE_CHECKING:`."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        for child in ast.iter_child_nodes(node):
            test = getattr(child, "test", None) if isinstance(child, ast.If) else None
            if test is not None and getattr(test, "id", getattr(test, "attr", None)) == "TYPE_CHECKING":
                todo.extend(child.orelse)
                continue
            todo.append(child)


def layer_of(module: str) -> int:
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            exact_package = p in ("specjax", "specjax.models")  # the packages themselves, not their modules
            hit = module == p if exact_package else (module == p or module.startswith(p + "."))
            if hit and len(p) > depth:
                best, depth = i, len(p)
    if best is None:
        raise AssertionError(f"{module} is in no layer of tests/test_layering.py: add it to LAYERS")
    return best


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def test_the_graph_sees_module_and_function_level_imports():
    graph = import_graph()
    assert "specjax.models.llama" in graph["specjax.loop"]  # `from specjax.models import llama`
    assert "specjax.models.model" in graph["specjax.drafters"]  # `from specjax.models.model import Model`
    assert "specjax.models.shards" in graph["specjax.models.model"]  # inside a function
    assert "specjax.backend" in graph["specjax.models.quant"]


def test_no_import_cycle_inside_specjax():
    assert find_cycle(import_graph()) is None, " -> ".join(find_cycle(import_graph()))


def test_no_arrow_from_a_lower_layer_to_a_higher_one():
    upward = [f"{m} ({LAYERS[layer_of(m)][0]}) imports {n} ({LAYERS[layer_of(n)][0]})"
              for m, targets in sorted(import_graph().items()) for n in sorted(targets)
              if layer_of(n) > layer_of(m)]
    assert not upward, "\n".join(upward)


def test_the_models_never_import_the_native_kernels():
    """The native kernels reach the models as `Backend.kernels`; quant and llama know only the
    `quant.Relaid` base of the kernels' layouts."""
    graph = import_graph()
    for m in ("specjax.models.quant", "specjax.models.llama", "specjax.loop"):
        assert not any(n.startswith("specjax.native") for n in graph[m]), (m, graph[m])


def test_a_cycle_and_an_upward_arrow_are_found():
    """The checks can fail: a made-up cycle, and a made-up arrow from pallas up to verify."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert layer_of("specjax.verify._asd") > layer_of("specjax.pallas.regret_prefix")
    assert layer_of("specjax.models.model") > layer_of("specjax.sharding._layout") > layer_of("specjax.models.llama")


# --- the path of one prompt: the files of specjax/ that one generation runs through ---

def prompt_path(draft="pld", method="fly", run=True, **engine_options) -> dict[str, set[str]]:
    """{file of specjax/: the functions of it called} while one `Engine.generate` traces and runs
    (run=False: while `Engine.lower` traces the same program, without compiling it).

    A tiny random model of a shape no other test compiles (so the program is traced here, not
    taken from jit's cache); sys.setprofile sees every Python call, so a helper moved out of the
    way but still called would still count."""
    import collections
    import sys

    import specjax
    from specjax.models import Config, random_model

    tiny = Config(vocab_size=61, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8, rope_theta=500.0)
    # the cost table given, as it is once measured (costs.py measures a machine once and keeps it on
    # disk; that one-time measurement is not a prompt's path)
    from specjax.costs import CostTable

    costs = CostTable(verify_s=(1.0, 1.2), draft_step_s=0.0, platform="cpu", source="test")
    engine = specjax.Engine(random_model(tiny, seed=3), draft=draft, method=method, k=1, max_new_tokens=4,
                            **{"costs": costs, **engine_options})
    root = str(ROOT) + "/"
    seen = collections.defaultdict(set)

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(root):
            seen[frame.f_code.co_filename[len(root):]].add(frame.f_code.co_name)

    sys.setprofile(profile)
    try:
        (engine.generate if run else engine.lower)([[1, 2, 3, 4, 1, 2, 3]])
    finally:
        sys.setprofile(None)
    return dict(seen)


def test_one_prompt_path():
    """One prompt through Engine(target, draft="pld", method="fly") (and "exact") runs functions of at
    most 8 files of specjax/: engine, loop, drafters, models/llama and quant, the native kernels (on a
    CPU), verify/_common and the rule's own page. A file more on the path is a helper that belongs
    beside its caller (or data computed before tracing), and the failure names every file.

    "exact" is traced only (`Engine.lower`): what runs on the host around the compiled program is
    the same code for every rule, seen with "fly", and a second compilation would double the time."""
    for method, page, run in (("fly", "verify/_fly.py", True), ("exact", "verify/_greedy.py", False)):
        seen = prompt_path("pld", method, run)
        listing = "\n".join(f"{f:24s} {' '.join(sorted(seen[f]))}" for f in sorted(seen))
        # the measurement has teeth: the program was traced here, the rule's page included
        assert {"engine.py", "loop.py", "drafters.py", "models/llama.py", "verify/_common.py", page} <= set(seen), listing
        assert len(seen) <= 8, f"method={method!r}: {len(seen)} files on the path of one prompt:\n{listing}"


def test_the_engine_resolves_its_backend_once():
    """The Engine's Backend holds the Pallas choices already made for its platform (plain data on the
    traced path): the rules call the plain statistics or the kernel without resolving them per trace."""
    import jax

    import specjax
    from specjax.models import Config, random_model

    tiny = Config(vocab_size=61, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                  num_kv_heads=1, head_dim=8, rope_theta=500.0)
    backend = specjax.Engine(random_model(tiny, seed=3), draft="pld", method="fly").backend
    on_accelerator = jax.default_backend() in ("gpu", "tpu")
    assert backend.pallas == ("kernel" if on_accelerator else "reference")
    assert backend.interpret is (not on_accelerator) and backend.variant in ("mosaic", "triton")
    assert backend.platform == jax.default_backend() and backend.native == (backend.matmul != "xla")
