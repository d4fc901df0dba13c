"""A preset's checkpoint for a test, or a skip when its package is not installed."""

import pytest


def resolve_or_skip(name: str):
    from specjax.models import presets

    try:
        return presets.resolve(name)
    except presets.PresetError as e:
        pytest.skip(str(e))
