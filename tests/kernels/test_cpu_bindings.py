"""The C kernels' binding table (radixgen/kernels/_cpu_bindings.py) against the prototypes the C source exports,
for every instruction set the kernels are built for: the same functions, each with the same return type and the
same arguments (count, C type and name, in order). Builds without AVX512-BF16 export stubs for the bf16-only
kernels; they are parsed from those builds' preprocessed source, so their signatures are checked too."""

from __future__ import annotations

import ctypes
import re
import shutil

import pytest

from radixgen.kernels import _cpu_build
from radixgen.kernels._cpu_bindings import DECLARATIONS, ELEMENT_TYPES, ctype_of

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                                reason="no C compiler")

# a top-level function definition or declaration: `<return type> rg_name(<params>) {` or `... ;`
_FUNCTION = re.compile(r"^(?!static\b)([A-Za-z_][\w ]*?[\s*]+)(rg_\w+)\s*\(([^()]*)\)\s*([{;])", re.M)


def _c_type(text: str) -> str:
    """A C type written with single spaces and `*` as separate words: 'const float *'."""
    return " ".join(re.sub(r"\*", " * ", text).split())


def _param(text: str) -> tuple[str, str]:
    m = re.fullmatch(r"(.*?)(\w+)", " ".join(text.split()))
    assert m is not None, text
    return m.group(2), _c_type(m.group(1))


def exported_prototypes(source: str) -> dict[str, tuple[str, list[tuple[str, str]]]]:
    """name -> (return type, [(argument name, C type)]) of every non-static function defined in `source`; a
    separate declaration of the same function must agree with its definition."""
    defined, declared = {}, {}
    for m in _FUNCTION.finditer(source):
        params = m.group(3).strip()
        args = [] if params in ("", "void") else [_param(p) for p in params.split(",")]
        (defined if m.group(4) == "{" else declared)[m.group(2)] = (_c_type(m.group(1)), args)
    for name, proto in declared.items():
        assert defined.get(name) == proto, f"{name}: declared {proto}, defined {defined.get(name)}"
    return defined


@pytest.fixture(scope="module", params=sorted(_cpu_build.ISAS))
def prototypes(request):
    return request.param, exported_prototypes(_cpu_build.preprocess(request.param))


def test_every_exported_function_is_declared_once_with_its_prototype(prototypes):
    isa, protos = prototypes
    assert set(protos) == set(DECLARATIONS), f"{isa}: exported but not declared {set(protos) - set(DECLARATIONS)}, "\
        f"declared but not exported {set(DECLARATIONS) - set(protos)}"
    for name, (restype, args) in DECLARATIONS.items():
        c_restype, c_args = protos[name]
        assert restype == c_restype, f"{isa} {name}: returns {c_restype}, declared {restype}"
        assert len(args) == len(c_args), f"{isa} {name}: {len(c_args)} arguments, declared {len(args)}"
        for i, (ours, theirs) in enumerate(zip(args, c_args, strict=True)):
            assert ours == theirs, f"{isa} {name} argument {i}: C has {theirs}, declared {ours}"


def test_the_parser_sees_what_it_must():
    """The prototype parser on a sample: definitions, declarations, stubs, statics and calls told apart."""
    src = """int rg_a(void) { return 0; }
static inline void rg_helper_f32(const float *x) { rg_a(); }
rg_status rg_b_bf16(const uint16_t *w, int64_t N,
                    float *out);
rg_status rg_b_bf16(const uint16_t *w, int64_t N,
                    float *out) {
    rg_helper_f32(w);
    return RG_OK;
}"""
    assert exported_prototypes(src) == {
        "rg_a": ("int", []),
        "rg_b_bf16": ("rg_status", [("w", "const uint16_t *"), ("N", "int64_t"), ("out", "float *")])}
    with pytest.raises(AssertionError, match="declared"):
        exported_prototypes(src.replace("int64_t N,\n                    float *out);", "int N, float *out);"))


def test_generic_kernels_are_declared_for_every_element_type():
    for suffix, elem in ELEMENT_TYPES.items():
        restype, args = DECLARATIONS[f"rg_store_kv_{suffix}"]
        assert restype == "void" and args[0] == ("k", f"const {elem} *")


def test_every_declared_type_has_a_ctypes_type():
    for name, (restype, args) in DECLARATIONS.items():
        ctype_of(restype)
        for arg, c_type in args:
            t = ctype_of(c_type)
            if c_type.endswith("*"):
                assert t is ctypes.c_void_p or any(s in c_type for s in ("rg_layer_bf16", "rg_weight")), (name, arg)
    assert ctype_of("float") is ctypes.c_float and ctype_of("int64_t") is ctypes.c_int64
    assert ctype_of("void") is None
