"""SpecConfig.parse: the one grammar of configuration names (CLI, benchmarks, evaluation)."""

from __future__ import annotations

import re

import pytest

from ralm.config import SpecConfig

FLAGS = ("prefetch", "adaptive_stride", "async_verify")

# name -> (P, S, A, stride, gamma_max)
VALID = [
    ("base", (False, False, False, 3, 0.6)),
    ("BASE", (False, False, False, 3, 0.6)),
    ("P", (True, False, False, 3, 0.6)),
    ("S", (False, True, False, 3, 0.6)),
    ("A", (False, False, True, 3, 0.6)),
    ("PSA", (True, True, True, 3, 0.6)),
    ("asp", (True, True, True, 3, 0.6)),
    (" PS ", (True, True, False, 3, 0.6)),
    ("s=4", (False, False, False, 4, 0.6)),
    ("Ps=8", (True, False, False, 8, 0.6)),
    ("PAs=2", (True, False, True, 2, 0.6)),
    ("PSA@0.9", (True, True, True, 3, 0.9)),
    ("S@0.9", (False, True, False, 3, 0.9)),
    ("s=4@0.8", (False, False, False, 4, 0.8)),
    ("spec:PSA@0.9", (True, True, True, 3, 0.9)),
    ("SPEC:ps", (True, True, False, 3, 0.6)),
    ("spec:base", (False, False, False, 3, 0.6)),
]


@pytest.mark.parametrize("name,want", VALID, ids=[n.strip() for n, _ in VALID])
def test_valid_names(name, want):
    sc = SpecConfig.parse(name)
    assert (sc.prefetch, sc.adaptive_stride, sc.async_verify, sc.stride, sc.gamma_max) == want


# name -> the start of the error message
INVALID = [
    ("", "empty RaLMSpec configuration name ''"),
    ("   ", "empty RaLMSpec configuration name '   '"),
    ("@0.9", "empty RaLMSpec configuration name '@0.9'"),
    ("spec:", "empty RaLMSpec configuration name 'spec:'"),
    ("PQ", "unknown RaLMSpec configuration 'PQ': use base, a combination of P, S, A, or [P][A]s=N"),
    ("seq", "unknown RaLMSpec configuration 'seq'"),
    ("spec", "unknown RaLMSpec configuration 'spec'"),
    ("S=4", "unknown RaLMSpec configuration 'S=4'"),
    ("bases=4", "unknown RaLMSpec configuration 'bases=4'"),
    ("PSs=4", "RaLMSpec configuration 'PSs=4': a fixed stride s=N cannot be combined with S"),
    ("s=", "the stride of RaLMSpec configuration 's=' is not an integer: ''"),
    ("s=x", "the stride of RaLMSpec configuration 's=x' is not an integer: 'x'"),
    ("s=4.5", "the stride of RaLMSpec configuration 's=4.5' is not an integer: '4.5'"),
    ("s=0", "invalid RaLMSpec configuration 's=0': stride: Input should be greater than or equal to 1"),
    ("s=300", "invalid RaLMSpec configuration 's=300': stride: Input should be less than or equal to 256"),
    ("PSA@", "the gamma cap of RaLMSpec configuration 'PSA@' is not a number, bayes or positional: ''"),
    ("PSA@x", "the gamma cap of RaLMSpec configuration 'PSA@x' is not a number, bayes or positional: 'x'"),
    ("PSA@0.9@1", "the gamma cap of RaLMSpec configuration 'PSA@0.9@1' is not a number, bayes or positional: '0.9@1'"),
    ("PSA@1.5", "invalid RaLMSpec configuration 'PSA@1.5': gamma_max: Input should be less than 1"),
    ("PSA@0", "invalid RaLMSpec configuration 'PSA@0': gamma_max: Input should be greater than 0"),
]


@pytest.mark.parametrize("name,message", INVALID, ids=[repr(n) for n, _ in INVALID])
def test_invalid_names_say_why(name, message):
    with pytest.raises(ValueError) as e:
        SpecConfig.parse(name)
    assert str(e.value).startswith(message)


def test_defaults_fill_the_other_fields_and_the_name_overrides_them():
    sc = SpecConfig.parse("PS@0.9", gamma_max=0.7, max_stride=32, prefetch_size=256, stride=5)
    assert (sc.gamma_max, sc.max_stride, sc.prefetch_size, sc.stride) == (0.9, 32, 256, 5)
    assert SpecConfig.parse("s=4", stride=5).stride == 4
    # the name alone decides P, S and A (e.g. defaults taken from a server's whole SpecConfig)
    server = SpecConfig.named("PSA", stride=7).model_dump()
    sc = SpecConfig.parse("s=2", **server)
    assert not (sc.prefetch or sc.adaptive_stride or sc.async_verify) and sc.stride == 2
    with pytest.raises(ValueError, match="invalid RaLMSpec configuration 'PSA': foo: Extra inputs"):
        SpecConfig.parse("PSA", foo=1)


def test_parse_extends_named():
    for name in ("base", "P", "S", "A", "PS", "PA", "SA", "PSA"):
        assert SpecConfig.parse(name) == SpecConfig.named(name)


def test_settings_after_a_semicolon_set_other_fields():
    """``;FIELD=VALUE`` sets any SpecConfig field but the P/S/A flags, validated like the rest."""
    sc = SpecConfig.parse("PSA@0.9;max_stride=4;shared_kb_direct_at=0", prefetch_size=64)
    assert (sc.prefetch, sc.adaptive_stride, sc.async_verify, sc.gamma_max) == (True, True, True, 0.9)
    assert (sc.max_stride, sc.shared_kb_direct_at, sc.prefetch_size) == (4, 0, 64)
    assert SpecConfig.parse("s=4; gamma_estimate = bayes").gamma_estimate == "bayes"
    for bad, msg in [
        ("PSA;prefetch=0", "bad setting 'prefetch=0'"),
        ("PSA;nope=1", "bad setting 'nope=1'"),
        ("PSA;max_stride", "bad setting 'max_stride'"),
        ("PSA;max_stride=0", "max_stride: Input should be greater than or equal to 1"),
        ("PSA;max_stride=x", "max_stride: Input should be a valid integer"),
        (";max_stride=4", "empty RaLMSpec configuration name"),
    ]:
        with pytest.raises(ValueError, match=re.escape(msg)):
            SpecConfig.parse(bad)
