"""Stage prepare: the fixed input set (ordinary and edge cases) and the training data, frozen to files.

Both files are replaced together or not at all (``files.StagedFolder``; DVC's ``.gitignore`` beside them is kept).
"""

from __future__ import annotations

from pipeline import cases, files, paths, task
from pipeline.config import load_params


def main(params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    data = task.load_data(params.task)
    fixed = cases.build(data, params.prepare)
    train, fixed_set = paths.PREPARED_TRAIN.name, paths.PREPARED_CASES.name
    with files.StagedFolder(paths.PREPARED, owned={train, fixed_set}) as out:
        task.save_train(out / train, data.train)
        cases.save(out / fixed_set, fixed)
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
