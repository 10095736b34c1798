"""Stage prepare: the fixed input set (ordinary and edge cases) and the training data, frozen to files."""

from __future__ import annotations

from pipeline import cases, paths, task
from pipeline.config import load_params


def main(params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    data = task.load_data(params.task)
    fixed = cases.build(data, params.prepare)
    task.save_train(paths.PREPARED_TRAIN, data.train)
    cases.save(paths.PREPARED_CASES, fixed)
    asked, available = params.prepare.ordinary_cases, task.rows(data.eval_x)  # what ``cases.build`` took the ordinary cases from
    if available < asked:
        print(
            f"prepare: prepare.ordinary_cases is {asked} but task.data gives {available} eval samples: "
            f"the fixed set takes all {available}"
        )
    kind = "a Dataset of" if isinstance(data.train, task.DatasetSource) else ""
    print(
        f"prepare: {len(fixed.ids)} cases ({sum(k == 'edge' for k in fixed.kinds)} edge), "
        f"{kind} {len(data.train)} training samples".replace("  ", " ")
    )
