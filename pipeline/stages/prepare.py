"""Stage prepare: the fixed input set (ordinary and edge cases) and the training data, frozen to files."""

from __future__ import annotations

from pipeline import cases, paths, task
from pipeline.artifacts import write_tensors
from pipeline.config import load_params


def main(params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    data = task.load_data(params.task)
    fixed = cases.build(data, params.prepare)
    write_tensors(paths.PREPARED_TRAIN, {"x": data.train_x.contiguous(), "y": data.train_y.contiguous()})
    cases.save(paths.PREPARED_CASES, fixed)
    print(f"prepare: {len(fixed.ids)} cases ({sum(k == 'edge' for k in fixed.kinds)} edge), {data.train_x.shape[0]} training samples")
