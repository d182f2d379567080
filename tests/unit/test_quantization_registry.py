"""The quantization methods' registry (radixserve/quantization/registry.py): its names are the
CLI's, unknown names are refused with the known ones, each method says what ``auto`` does with
it, and ``auto`` resolves as hardware.resolve_quantization (which sits below the package and
keeps its own copy of the rule) does, for every model format, GGUF tensor types, device and
rank count."""

from __future__ import annotations

import itertools

import pytest
import torch

from radixserve import cpu_ext
from radixserve.checkpoint import gguf_index
from radixserve.config import INT8_ACTIVATION_MODES, QUANTIZATIONS
from radixserve.hardware import check_quantization_device, resolve_quantization
from radixserve.quantization import Int4Weight, Int8Weight, registry
from radixserve.quantization.base import QuantMethod


def test_the_registry_names_are_the_clis() -> None:
    assert registry.names() + ("auto",) == QUANTIZATIONS


def test_an_unknown_name_is_refused_with_the_known_ones() -> None:
    known = r"must be one of \['none', 'int8', 'int4', 'gguf'\], got 'q3'"
    with pytest.raises(ValueError, match=known):
        registry.get_method("q3")
    with pytest.raises(ValueError, match="got 'auto'"):  # resolved before a method is asked for
        registry.get_method("auto")


@pytest.mark.parametrize(("name", "auto_rank", "quantizes_float", "serves_gguf"), [
    ("none", 0, False, False), ("int8", None, True, False), ("int4", None, True, False),
    ("gguf", 1, False, True)])
def test_each_method(name: str, auto_rank: int | None, quantizes_float: bool,
                     serves_gguf: bool) -> None:
    method = registry.get_method(name)
    assert isinstance(method, QuantMethod) and method.name == name
    assert method.auto_rank == auto_rank  # auto: gguf where it applies, else none; never int8/4
    assert method.quantizes_float == quantizes_float
    assert bool(method.gguf_types) == serves_gguf
    assert method.int8_activations == (name in INT8_ACTIVATION_MODES)
    assert method.one_rank == (name != "none")  # config: quantized weights are served by one rank
    assert registry.resolve(name, None, True, 1) == name  # a name other than auto stays
    ops = cpu_ext.load()
    if ops is not None:
        assert method.kernels() and all(hasattr(ops, kernel) for kernel in method.kernels())


def test_the_gguf_types_are_the_ones_the_header_reader_counts() -> None:
    assert registry.get_method("gguf").gguf_types == registry.gguf_types()
    assert set(registry.gguf_types()) == set(gguf_index.SERVED_TYPES)
    for kind in registry.gguf_types():
        reader = registry.get_gguf_type(kind)
        assert reader.kind == kind and reader.block_bytes == gguf_index.BLOCK_BYTES[kind]
    assert registry.get_gguf_type("F16") is None


def test_a_weights_kernels_are_the_ones_it_names() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(8, 64, generator=gen)
    weights = (Int8Weight.quantize(w), Int8Weight.quantize(w, asymmetric=True),
               Int4Weight.quantize(w))
    for weight in weights:
        for flags in itertools.product((False, True), repeat=2):
            weight.int8_activations = flags[0]
            weight.wide_one_row = flags[1]
            assert {weight.kernel_args(rows)[0] for rows in (1, 2)} <= set(type(weight).kernels)


_TYPE_SETS = [(), ("F32",), ("F16", "F32"), ("Q4_0",), ("Q4_1", "F32"), ("Q8_0",),
              ("type 12", "F32"), ("Q4_1", "Q8_0", "F32"), ("type 14",)]


@pytest.mark.parametrize("types", _TYPE_SETS)
def test_auto_resolves_as_hardware_does(types: tuple[str, ...],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every (name, model format, GGUF tensor types present, CPU or not, ranks): the registry's
    rule and hardware.resolve_quantization's give the same method."""
    tensors = {f"t{i}": gguf_index.GGUFTensor(f"t{i}", kind, (64, 8), 0)
               for i, kind in enumerate(types)}
    index = gguf_index.GGUFIndex("llama", tensors)
    monkeypatch.setattr(gguf_index, "read_gguf_index", lambda path: index)
    for name, source, on_cpu, tp_size in itertools.product(QUANTIZATIONS, (None, "model.gguf"),
                                                           (True, False), (1, 2)):
        want = resolve_quantization(name, source, on_cpu, tp_size)
        got = registry.resolve(name, source, on_cpu, tp_size)
        assert got == want, (name, source, on_cpu, tp_size)
    served = bool(set(types) & set(registry.gguf_types()))
    assert registry.resolve("auto", "model.gguf", True, 1) == ("gguf" if served else "none")


@pytest.mark.parametrize("name", registry.names())
def test_a_gpu_refuses_the_methods_with_cpu_kernels(name: str) -> None:
    """hardware's check (below the package) and each method's ``on_gpu`` agree: on a CPU every
    method runs; on a GPU only the float method, the others refused naming the way out."""
    check_quantization_device(name, on_cpu=True)
    if registry.get_method(name).on_gpu:
        check_quantization_device(name, on_cpu=False)
    else:
        with pytest.raises(ValueError, match=f"quantization {name} multiplies its weights with "
                                             "the CPU kernels.*--device cpu"):
            check_quantization_device(name, on_cpu=False)
    assert registry.get_method(name).on_gpu == (name == "none")
