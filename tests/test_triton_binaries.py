"""dsp-triton's cubin cache (dsp_triton/binaries.py), on the CPU: what is stored, what a damaged entry
becomes, which kernels DSP's own loader takes, and what the key covers.

The GPU half (a warm process loads every kernel from this cache and never imports torch or
Triton's compiler) is tests/gpu/test_llm_warm_start_gpu.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

binaries = pytest.importorskip("dsp_triton.binaries")
from dsp_cuda_graphs import launch  # noqa: E402

SOURCE = "@triton.jit\ndef k(x_ptr, y_ptr):\n    pass\n"
F32 = ("float32", "float32")


def _cubin(**kw: object) -> object:
    fields = {"name": "k", "num_warps": 4, "shared": 1024, "pdl": True, "image": b"\x7fELF cubin bytes"}
    fields.update(kw)
    return binaries.Cubin(**fields)


def test_a_stored_cubin_reads_back_as_it_was(tmp_path: Path) -> None:
    store = binaries.CubinCache(tmp_path)
    key = binaries.entry_key(SOURCE, 4, True, (True, True), "90", F32)
    assert store.get(key) is None
    store.put(key, _cubin())
    assert store.get(key) == _cubin()
    assert sorted(p.name for p in (tmp_path / "cubin").iterdir()) == sorted(
        [f"{key}.cubin", f"{key}.cubin.b2", f"{key}.json", f"{key}.json.b2"]
    )


@pytest.mark.parametrize("damaged", ["cubin", "json"])
def test_a_damaged_entry_is_a_miss_and_is_removed(tmp_path: Path, damaged: str) -> None:
    store = binaries.CubinCache(tmp_path)
    key = binaries.entry_key(SOURCE, 4, False, (True, True), "90", F32)
    store.put(key, _cubin(pdl=False))
    path = tmp_path / "cubin" / f"{key}.{damaged}"
    path.write_bytes(path.read_bytes()[:-3])  # truncated, as a crash mid-write would leave it
    assert store.get(key) is None
    assert not path.exists()
    store.put(key, _cubin(pdl=False))  # the next compile stores it again
    assert store.get(key) == _cubin(pdl=False)


def test_an_entry_of_another_format_is_a_miss(tmp_path: Path) -> None:
    from dsp_triton.cache import write_checked

    store = binaries.CubinCache(tmp_path)
    store.put("k1", _cubin())
    write_checked(tmp_path / "cubin" / "k1.json", b'{"format": 0, "name": "k", "num_warps": 4, "shared": 0, "pdl": 0}')
    assert store.get("k1") is None


def test_the_key_covers_what_changes_the_binary_or_its_launch() -> None:
    base = binaries.entry_key(SOURCE, 4, True, (True, True), "90", F32)
    assert binaries.entry_key(SOURCE, 4, True, (True, True), "90", F32) == base
    others = [
        binaries.entry_key(SOURCE + "\n", 4, True, (True, True), "90", F32),
        binaries.entry_key(SOURCE, 8, True, (True, True), "90", F32),
        binaries.entry_key(SOURCE, 4, False, (True, True), "90", F32),
        binaries.entry_key(SOURCE, 4, True, (False, True), "90", F32),  # an input not 16-byte aligned
        binaries.entry_key(SOURCE, 4, True, (True, True), "100", F32),
        # the same source over int16 inputs: Triton compiles the pointers' types into the binary
        binaries.entry_key(SOURCE, 4, True, (True, True), "90", ("int16", "int16")),
    ]
    assert len({base, *others}) == 7


def _compiled(**metadata: object) -> object:
    md = {"name": "k", "num_warps": 4, "shared": 2048, "launch_pdl": False, "global_scratch_size": 0}
    md.update(profile_scratch_size=0, num_ctas=1, launch_cooperative_grid=False)
    md.update(metadata)
    return SimpleNamespace(metadata=SimpleNamespace(**md), asm={"cubin": b"image", "ptx": "..."})


def test_a_plain_kernel_is_taken_by_dsps_loader() -> None:
    assert binaries.from_compiled(_compiled(launch_pdl=True)) == binaries.Cubin("k", 4, 2048, True, b"image")


@pytest.mark.parametrize(
    "metadata",
    [
        {"global_scratch_size": 64},
        {"profile_scratch_size": 8},
        {"num_ctas": 2},
        {"launch_cooperative_grid": True},
        {"tensordesc_meta": [{"block": 16}]},
    ],
)
def test_a_kernel_outside_the_abi_keeps_tritons_launcher(metadata: dict[str, object]) -> None:
    assert binaries.from_compiled(_compiled(**metadata)) is None


def test_no_cubin_no_loader() -> None:
    kernel = _compiled()
    kernel.asm = {"ptx": "..."}  # type: ignore[attr-defined]
    assert binaries.from_compiled(kernel) is None


def test_the_version_and_the_dependent_launch_probe_import_no_triton() -> None:
    code = (
        "import sys; from dsp_triton import binaries, kernels; "
        "v = binaries.triton_version(); d = binaries.has_dependent_launch(); "
        "print(isinstance(v, str), isinstance(d, bool), 'triton' in sys.modules, 'torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.split() == ["True", "True", "False", "False"], done.stderr[-2000:]


def test_a_launch_without_a_cuda_driver_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launch, "_driver", False)  # probed: no libcuda here
    with pytest.raises(RuntimeError, match="cuLaunchKernelEx"):
        launch.launch_pointers(SimpleNamespace(ptr=0), (1, 1, 1), 32, [0], 0)
