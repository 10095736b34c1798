"""Stage report: the figures of the report, per variant, and the flat curves that `dvc plots` draws.

Deterministic, like every DVC output but the benchmark: it reads no timing. The HTML report, which
quotes the benchmark, is assembled from these figures by publish and lives in MLflow. Outputs are read
with safetensors' numpy loader (``outputs.NumpyReader``): this stage never imports torch. Its two folders are replaced
together or not at all (``files.StagedFolder``): a variant no longer run loses its files, anything else there stays.
"""

from __future__ import annotations

from pipeline import files, paths
from pipeline.artifacts import comparison, outputs, reference, report, trial
from pipeline.config import load_params
from pipeline.present import plots


def main(params_path: str = "params.yaml") -> None:
    params = load_params(params_path)
    ref = reference.read_manifest()
    ref_steps, noise = reference.read_trajectory(ref), reference.read_replicate(ref)
    ref_outputs = outputs.NumpyReader(paths.REF_OUTPUTS, ref.sha256(paths.REF_OUTPUTS), reference.PRODUCED_BY)
    band, names, written = params.acceptance, frozenset(params.trial.policies), 0
    def own(rel, folders, stems, suffix):  # what ``report.Files`` writes: FOLDER/STEM.SUFFIX (anything else stays)
        return len(rel.parts) == 2 and rel.parts[0] in folders and rel.stem in stems and rel.suffix == suffix

    with (files.StagedFolder(paths.REPORT / "plots", owned=lambda r: own(r, names, report.FIGURES, ".png")) as plot_dir,
          files.StagedFolder(paths.REPORT_CURVES, owned=lambda r: own(r, report.FAMILIES, names, ".json")) as curve_dir):
        for d in params.trial.variants:
            ran = trial.read_manifest(d)
            if ran.failed:  # it raised under its policy: no outputs and no curve to draw (its decision says where)
                continue
            steps = trial.read_trajectory(d, ran).steps
            trial_outputs = outputs.NumpyReader(paths.trial(d) / paths.TRIAL_OUTPUTS, ran.files[paths.TRIAL_OUTPUTS],
                                                trial.produced_by(d))
            stats = comparison.read(d)
            drawn = report.sample(ref_outputs.ids, ref_outputs.elements_per_case, {f.id for f in stats.flips.flip_list})
            ref_out, trial_out = ref_outputs.read(drawn.rows), trial_outputs.read(drawn.rows)
            tolerances = {n: (g.atol, g.rtol) for n, g in stats.values.items()}
            atols = {n: t[0] for n, t in tolerances.items()}
            for name, png in (("loss", plots.loss_curves(ref_steps, steps, d, band, noise)),
                              ("scale", plots.loss_scale(steps, d)),
                              ("envelope", plots.error_envelope(ref_out, trial_out, tolerances, d, drawn.flipped, drawn.note)),
                              ("errors", plots.error_histogram(ref_out, trial_out, atols, d, drawn.note))):
                files.write_bytes(plot_dir / d / f"{name}.png", png)
                written += 1
            for family, curve in plots.curve_rows(ref_steps, steps, d, band, noise).items():
                files.write_json(curve_dir / family / f"{d}.json", curve)
                written += 1
    print(f"report: {written} figure and curve file(s) under {paths.REPORT} for {', '.join(params.trial.variants)}")
