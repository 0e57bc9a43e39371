"""What the documentation promises a newcomer: README's install command brings every package the library
and the lessons import (matplotlib too: lesson 03, --trace and llmz.plot draw figures), and every repository
file the Markdown names or shows exists."""
import ast
import configparser
import re
import sys

from mpirun import REPO

# imported only on the paths that need them, each from an extra (or, torch, by whoever compares against it)
OPTIONAL = {"cupy": "gpu", "cupyx": "gpu", "cupy_backends": "gpu", "ml_dtypes": "gpu", "tiktoken": "bpe",
            "torch": None}
DISTRIBUTION = {"cupy": "cupy-cuda13x", "cupyx": "cupy-cuda13x", "cupy_backends": "cupy-cuda13x"}


def requirements(text: str) -> set[str]:
    return {re.split(r"[<>=!~ ]", line.strip())[0].lower() for line in text.splitlines()
            if line.strip() and not line.strip().startswith("#")}


def third_party_imports() -> dict[str, str]:
    """module -> a file importing it, over llmz/ and lessons/."""
    found = {}
    for path in [*(REPO / "llmz").rglob("*.py"), *(REPO / "lessons").glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("llmz", "lessons"):
                    found.setdefault(top, str(path.relative_to(REPO)))
    return found


def test_readme_install_brings_every_package_the_library_and_lessons_import():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    extras = {k: requirements(v) for k, v in cfg["options.extras_require"].items()}
    readme = (REPO / "README.md").read_text()
    install = re.search(r'pip install -e "\.\[([\w,]+)\]" && python -m llmz\.train', readme)
    assert install, "README's first command changed: update this test"
    have = requirements(cfg["options"]["install_requires"])
    for extra in install.group(1).split(","):
        have |= extras[extra]
    imported = third_party_imports()
    assert "matplotlib" in imported
    for module, where in imported.items():
        if module in OPTIONAL:
            extra = OPTIONAL[module]
            assert extra is None or DISTRIBUTION.get(module, module) in extras[extra], (module, extra)
        else:
            assert DISTRIBUTION.get(module, module) in have, \
                f"{where} imports {module}, which README's install ({install.group(0)}) does not bring"


# `path/with.ext` in backticks, and the targets of Markdown links and images
NAMED = re.compile(r"`([\w./-]+/[\w.-]+\.(?:py|md|png|bin|txt|cfg|sh|toml))`|\]\(([^)#:]+)\)")
RUN_OUTPUTS = ("lessons_out/", "runs/", "ck/", "/tmp/")


def test_every_file_the_markdown_names_exists():
    missing = []
    for md in ["README.md", "BENCHMARKS.md", "lessons/README.md", "data/README.md"]:
        text = (REPO / md).read_text()
        for m in NAMED.finditer(text):
            name = m.group(1) or m.group(2)
            if name.startswith(RUN_OUTPUTS) or "://" in name:
                continue
            here = (REPO / md).parent
            if not ((REPO / name).exists() or (here / name).exists()):
                missing.append(f"{md}: {name}")
    assert not missing, missing
