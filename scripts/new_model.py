"""Point the pipeline at your own model: ``python scripts/new_model.py ~/mymodel/mymodel.py``.

Does steps 1 and 3 of the README's "Your model in three steps", and the task lines of step 2:

- writes a module template at PATH (a small MLP on seeded data, torch only) unless the file exists;
- adds PATH, absolute, under each ``- pipeline/examples`` of dvc.yaml's deps (the six stages that build the model),
  so that editing the module re-runs them; once only;
- sets ``task.model`` and ``task.data`` in params.yaml to ``MODULE:build_model`` and ``MODULE:load_data``, keeping
  every comment;
- prints what is left: the values marked ``[digits example]`` in params.yaml, PYTHONPATH, ``dvc repro``.

Run it from the repository root. It changes nothing else, and nothing at all when it cannot do all of it.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TEMPLATE = '''\
"""Your model and data for the AMP validation pipeline (params.yaml task.model, task.data)."""
import torch


def build_model():
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))  # float32


def load_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(768, 16, generator=g)
    y = x[:, :4].argmax(dim=1)  # a rule the model can learn: replace with your data
    return {"train_x": x[:512], "train_y": y[:512], "eval_x": x[512:], "eval_y": y[512:]}
'''
ANCHOR = re.compile(r"(?m)^( *)- pipeline/examples\b.*$")


def add_deps(text: str, module: Path) -> tuple[str, int]:
    """dvc.yaml's text with ``- MODULE`` under each ``- pipeline/examples`` that lacks it; and how many were added."""
    line = f"- {module}"
    added = 0

    def under(match: re.Match) -> str:
        nonlocal added
        rest = text[match.end() :].split("\n", 2)
        if len(rest) > 1 and rest[1].strip() == line:
            return match.group(0)
        added += 1
        return f"{match.group(0)}\n{match.group(1)}{line}"

    return ANCHOR.sub(under, text), added


def set_task(text: str, name: str) -> str:
    """params.yaml's text with task.model and task.data naming ``name``'s functions, comments kept.

    Raises:
        ValueError: the task section or one of its two keys is not found.
    """
    block = re.search(r"(?ms)^task:\n(.*?)(?=^\S|\Z)", text)
    if block is None:
        raise ValueError("params.yaml has no top-level task: section")
    body = block.group(1)
    for key, function in (("model", "build_model"), ("data", "load_data")):
        body, n = re.subn(rf"(?m)^(  {key}:[ \t]*)[^#\n]*?([ \t]*(#.*)?)$", rf"\g<1>{name}:{function}\g<2>", body, count=1)
        if n != 1:
            raise ValueError(f"params.yaml task: has no '{key}:' line")
    return text[: block.start(1)] + body + text[block.end(1) :]


def main(argv: list[str] | None = None, root: Path = Path(".")) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="your module's file, e.g. ~/mymodel/mymodel.py (outside this repository)")
    args = parser.parse_args(argv)
    module = args.path.expanduser().resolve()
    name = module.stem
    if module.suffix != ".py" or not name.isidentifier():
        print(f"error: {args.path} must be a .py file whose name is a Python module name, e.g. mymodel.py", file=sys.stderr)
        return 2
    dvc_yaml, params = root / "dvc.yaml", root / "params.yaml"
    if not dvc_yaml.is_file() or not params.is_file():
        print("error: run it from the repository root (dvc.yaml and params.yaml not found here)", file=sys.stderr)
        return 2
    deps, added = add_deps(dvc_yaml.read_text(), module)
    try:
        task = set_task(params.read_text(), name)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if not ANCHOR.search(deps):
        print("error: dvc.yaml lists no '- pipeline/examples' dep to add the module beside", file=sys.stderr)
        return 2
    if not module.exists():
        module.parent.mkdir(parents=True, exist_ok=True)
        module.write_text(TEMPLATE)
        print(f"wrote {module}: a template; replace build_model and load_data with yours")
    dvc_yaml.write_text(deps)
    params.write_text(task)
    print(f"dvc.yaml: {module} added to the deps of {added} stage(s)" if added else "dvc.yaml: already lists the module")
    print(f"params.yaml: task.model {name}:build_model, task.data {name}:load_data")
    print("next: review the values marked [digits example] in params.yaml (task.loss, the recipe, acceptance.min_quality,")
    print("      acceptance.outputs), then:")
    print(f'      export PYTHONPATH="{module.parent}"')
    print("      dvc repro")
    return 0


if __name__ == "__main__":
    sys.exit(main())
