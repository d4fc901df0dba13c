"""specjax: loose speculative decoding for Llama-family models in JAX.

    import specjax
    from specjax import models, verify
    m = models.load("smollm2-135m-instruct")
    out = specjax.Engine(target=m, max_new_tokens=64).generate([m.tokenizer.encode("Hello")])
"""

from specjax import models
from specjax.engine import Engine, GenerateOutput

__all__ = ["Engine", "GenerateOutput", "models"]
