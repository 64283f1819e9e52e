"""What a new user reads: the README and docs/ point only inside the repository, the design's
sections that the code cites exist, the README's example is examples/embed.py (which the GPU
tests run), and the public API documents itself."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DESIGN = ROOT / "docs" / "design.md"

# Pointers to a design document that only the project's authors have (../shared/DESIGN.md).
OUTSIDE = re.compile(r"\.\./shared|DESIGN\.md|DESIGN sections? \d")


def user_facing_files():
    files = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "epserve").rglob("*.py")),
             *sorted((ROOT / "examples").rglob("*.py")), *sorted((ROOT / "launch").rglob("*.py")),
             *sorted((ROOT / "cuda").rglob("*.cu*"))]
    return [f for f in files if "_cuda" not in f.parts]


@pytest.mark.parametrize("path", user_facing_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_pointer_outside_the_repository(path):
    hits = [f"{n}: {line.strip()}" for n, line in enumerate(path.read_text().splitlines(), 1) if OUTSIDE.search(line)]
    assert not hits, f"{path.relative_to(ROOT)} points outside the repository:\n" + "\n".join(hits)


def design_headings() -> set[str]:
    return {m.group(1).strip() for m in re.finditer(r"^#{2,3} (.+)$", DESIGN.read_text(), re.M)}


def test_the_sections_the_code_cites_exist():
    """`docs/design.md, "Name"` in the code names a heading of docs/design.md."""
    headings = design_headings()
    cited = {}
    for path in user_facing_files():
        for m in re.finditer(r'docs/design\.md[^"\n]{0,4}((?:"[^"\n]+"(?:, )?)+)', path.read_text()):
            for name in re.findall(r'"([^"]+)"', m.group(1)):
                cited.setdefault(name, path.relative_to(ROOT))
    assert cited, "no code cites docs/design.md"
    missing = {name: str(where) for name, where in cited.items() if name not in headings}
    assert not missing, f"cited sections that docs/design.md lacks: {missing}"


def test_readme_links_the_design_and_the_design_covers_the_contracts():
    assert "(docs/design.md)" in (ROOT / "README.md").read_text()
    headings = design_headings()
    for section in ("Layouts", "src_info", "The sink interface", "Signalling and epochs", "IPC lifetime", "Limits",
                    "Error semantics", "Synchronisation"):
        assert section in headings, section


def test_readme_example_is_the_example_the_gpu_tests_run():
    readme = (ROOT / "README.md").read_text()
    example = (ROOT / "examples" / "embed.py").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, re.S)
    assert blocks, "the README shows no Python example"
    assert blocks[0] == example[example.index("import cupy"):], "README's example differs from examples/embed.py"
    assert "mpirun -n 2 python -m mpi4py examples/embed.py" in readme
    for name in ("w13 =", "w2 =", "x =", "topk_idx =", "topk_weights ="):  # everything forward takes is defined
        assert name in blocks[0], name


def test_public_api_documents_itself():
    from epserve import EPService, MoEConfig

    assert "one rank's share" in (EPService.__doc__ or "").lower()
    init = EPService.__init__.__doc__ or ""
    assert "comm " in init and "device " in init and "Raises" in init
    forward = EPService.forward.__doc__ or ""
    for needed in ("[T, H]", "[E_loc, 2I, H]", "[E_loc, H, I]", "int32", "float32", "bf16", '"peer"', '"null"',
                   '"direct"', '"nccl"', "out ", "Synchronization", "stream", "RankFailedError", "ConfigError",
                   "PeerTimeoutError", "check()"):
        assert needed in forward, needed
    config = MoEConfig.__doc__ or ""
    for field in ("num_experts", "top_k", "hidden", "intermediate", "max_tokens_per_rank", "world_size",
                  "max_recv_rows", "wait_timeout_s"):
        assert re.search(rf"^\s+{field}\s", config, re.M), field


@pytest.mark.parametrize("path", user_facing_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_path_named_exists(path):
    """`epserve/.../name.py` in the docs, code comments and kernel sources names a file that
    is there (modules move when the package is regrouped)."""
    named = set(re.findall(r"\bepserve/[\w/]+\.py\b", path.read_text()))
    missing = sorted(n for n in named if not (ROOT / n).is_file())
    assert not missing, f"{path.relative_to(ROOT)} names modules that do not exist: {missing}"
