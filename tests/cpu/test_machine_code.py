"""epserve.runtime.machine_code on cubins NVRTC builds here (no GPU needed): the digest sees
the kernels' instructions and nothing else; the listing decodes each instruction's controls."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from epserve.runtime import build, machine_code


@pytest.fixture
def kernels_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(build, "CUDA_ROOT", tmp_path)
    return tmp_path


def _cubin(root, name, text, defines=None):
    (root / name).write_text(text)
    return build.compile_source(name, defines).cubin


def test_each_kernel_has_its_text_section(kernels_dir):
    cubin = _cubin(kernels_dir, "two.cu", 'extern "C" __global__ void first(int* x) { *x = 1; }\n'
                                         'extern "C" __global__ void second(float* y) { *y *= 3.f; }\n')
    sections = machine_code.text_sections(cubin)
    assert set(sections) == {".text.first", ".text.second"}
    assert all(len(code) > 0 and len(code) % 16 == 0 for code in sections.values())  # 16-byte instructions


def test_comments_and_line_numbers_do_not_change_the_digest(kernels_dir):
    plain = _cubin(kernels_dir, "a.cu", 'extern "C" __global__ void k(int* x, int v) { x[threadIdx.x] = v * 7; }\n')
    spaced = _cubin(kernels_dir, "b.cu", '// a comment\n\n\nextern "C" __global__ void k(int* x, int v) {\n'
                                        '  x[threadIdx.x] = v * 7;  // another\n}\n')
    assert plain.read_bytes() != spaced.read_bytes()  # the line tables differ
    assert machine_code.digest(plain) == machine_code.digest(spaced)


def test_other_code_or_another_kernel_name_changes_the_digest(kernels_dir):
    src = 'extern "C" __global__ void k(int* x, int v) { x[threadIdx.x] = v * V; }\n'
    seven, eight = (_cubin(kernels_dir, "k.cu", src, {"V": v}) for v in (7, 9))
    renamed = _cubin(kernels_dir, "r.cu", src.replace("void k(", "void other("), {"V": 7})
    digests = {machine_code.digest(c) for c in (seven, eight, renamed)}
    assert len(digests) == 3


def test_a_file_that_is_not_a_cubin_is_refused(tmp_path):
    path = tmp_path / "x.cubin"
    path.write_bytes(b"not an elf file at all")
    with pytest.raises(ValueError, match="ELF64"):
        machine_code.digest(path)


# Three instructions of the FP8 GEMM's k-loop as nvdisasm -c -hex prints them (H100 build of
# the thirty-eighth session): a barrier test that sets scoreboard 1, the wgmma wait, and an
# fma whose operand b is kept for the next instruction.
LISTING = """
//--------------------- .text.epserve_grouped_gemm_fp8 --------------------------
	.section	.text.epserve_grouped_gemm_fp8,"ax",@progbits
        /*2120*/                   SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR40+0x34f80], R24 ;        /* 0x034f8018ff0075a7 */
                                                                                                   /* 0x000e620008000168 */
        /*2490*/                   WARPGROUP.DEPBAR.LE gsb0, 0x0 ;                                 /* 0x00008000000079c5 */
                                                                                                   /* 0x000fce0000010000 */
.L_x_7:
        /*24c0*/                   FFMA R204, R25, R4.reuse, R204 ;                                /* 0x0000000419cc7223 */
                                                                                                   /* 0x080fe200000000cc */
"""


def test_a_listing_is_read_with_its_controls():
    wait, depbar, fma = machine_code.parse_listing(LISTING)
    assert {i.kernel for i in (wait, depbar, fma)} == {"epserve_grouped_gemm_fp8"}
    assert (wait.address, depbar.address, fma.address) == (0x2120, 0x2490, 0x24C0)
    assert fma.text == "FFMA R204, R25, R4.reuse, R204"
    assert fma.control == machine_code.Control(stall=1, yield_bit=1, write_barrier=None, read_barrier=None,
                                               wait_mask=0, reuse=0b010)  # operand b, the ".reuse" one
    assert wait.control.write_barrier == 1 and wait.control.reuse == 0
    assert depbar.control.stall == 7 and depbar.control.yield_bit == 0


def test_the_listing_job_refuses_a_define_the_build_does_not_read():
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, str(root / "launch" / "jobs" / "sass_listing.py"), "gemm_fp8_null",
                          "--define", "EPSERVE_GEMM_FP8_NO_SUCH_KNOB=1"], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(root)})
    assert out.returncode == 2 and "EPSERVE_GEMM_FP8_NO_SUCH_KNOB" in out.stderr


def test_a_cubin_is_listed_with_the_nvdisasm_the_test_extra_installs(tmp_path, monkeypatch):
    tool = machine_code.find_nvdisasm()
    if tool is None:  # installed with epserve[test]; a machine without it skips
        pytest.skip("no nvdisasm here (pip install nvidia-cuda-nvdisasm)")
    monkeypatch.setenv("EPSERVE_CACHE_DIR", str(tmp_path / "cache"))
    cubin = build.compile_source("probes/fp8_consumer_loop.cu", {"EPSERVE_PROBE_LEVEL": 3}).cubin
    code = machine_code.listing(cubin, tool)
    assert sum("QGMMA" in i.text for i in code) == 8  # two halves of four m64n128k32 wgmmas a k-block
    assert all(i.kernel == "epserve_probe_fp8_consumer_loop" for i in code)
