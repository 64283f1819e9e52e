"""epserve.runtime.machine_code on cubins NVRTC builds here (no GPU needed): the digest sees
the kernels' instructions and nothing else."""

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
