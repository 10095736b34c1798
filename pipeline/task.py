"""The task contract: the user's model and data functions, their inputs as given, their outputs as named tensors.

Inputs are what users have: a tensor, or a dict of tensors sharing their first dimension
(``input_ids``, ``attention_mask``, ``pixel_values``...), every dtype kept as given (token ids stay
integers; autocast decides the compute precision). A dict is called ``model(**batch)``, a tensor
``model(x)``. Training data may also be a map-style ``torch.utils.data.Dataset`` (larger than memory):
batches are then read item by item in the same seeded order as tensors would be.

Outputs may be a tensor, a dict of named tensors, or a Hugging Face ``ModelOutput`` (every head it returns);
``named_outputs`` turns each into a dict.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Union

import torch

from pipeline.artifacts.record import Record
from pipeline.files import read_tensors, sha256_file, write_tensors
from pipeline import heads
from pipeline.config import TaskConfig
from pipeline.heads import DEFAULT_OUTPUT, primary_by_order, primary_name
from pipeline.errors import UserError

IGNORE_INDEX = -100
"""Targets equal to this are ignored by cross_entropy and by per-token checks, as Hugging Face does."""


class Batch(dict):
    """Named input tensors sharing dim 0. Indexing with a name gives a tensor; any other index
    (slice, index tensor, list) selects rows of every tensor, as it would on one tensor."""

    def __getitem__(self, key):
        if isinstance(key, str):
            return dict.__getitem__(self, key)
        return Batch({k: v[key] for k, v in self.items()})

    @property
    def shape(self) -> torch.Size:
        """Only the row count, so code written for one tensor (``x.shape[0]``) keeps working."""
        return torch.Size([rows(self)])

    def to(self, device) -> "Batch":
        return Batch({k: v.to(device) for k, v in self.items()})


Inputs = Union[torch.Tensor, Batch]


def rows(x: Inputs) -> int:
    if torch.is_tensor(x):
        return x.shape[0]
    return next(iter(x.values())).shape[0]


def take(x: Inputs, idx) -> Inputs:
    return x[idx]


def to_device(x: Inputs, device: torch.device) -> Inputs:
    return x.to(device)


def cat(parts: list[Inputs]) -> Inputs:
    if torch.is_tensor(parts[0]):
        return torch.cat(parts)
    return Batch({k: torch.cat([p[k] for p in parts]) for k in parts[0]})


def stack(items: list[Inputs]) -> Inputs:
    if torch.is_tensor(items[0]):
        return torch.stack(items)
    return Batch({k: torch.stack([i[k] for i in items]) for k in items[0]})


def tensors_of(x: Inputs) -> dict[str, torch.Tensor]:
    return {"": x} if torch.is_tensor(x) else dict(x)


def is_floating(x: Inputs) -> bool:
    """Every input tensor is floating point: inputs may then be scaled and interpolated."""
    return all(t.is_floating_point() for t in tensors_of(x).values())


def map_floating(x: Inputs, fn: Callable[[torch.Tensor], torch.Tensor]) -> Inputs:
    """Apply ``fn`` to floating tensors only (integers, masks and ids are left as they are)."""
    if torch.is_tensor(x):
        return fn(x) if x.is_floating_point() else x
    return Batch({k: fn(v) if v.is_floating_point() else v for k, v in x.items()})


def flatten(x: Inputs, prefix: str = "x") -> dict[str, torch.Tensor]:
    """Tensors for a safetensors file: ``x`` for a tensor, ``x.<name>`` for each tensor of a dict."""
    if torch.is_tensor(x):
        return {prefix: x.contiguous()}
    return {f"{prefix}.{k}": v.contiguous() for k, v in x.items()}


def unflatten(tensors: Mapping[str, torch.Tensor], prefix: str = "x") -> Inputs:
    if prefix in tensors:
        return tensors[prefix]
    named = {k[len(prefix) + 1 :]: v for k, v in tensors.items() if k.startswith(prefix + ".")}
    if not named:
        raise KeyError(prefix)
    return Batch(sorted(named.items()))


def call(model: torch.nn.Module, x: Inputs, **extra: Any) -> Any:
    """``model(**x)`` for a dict of inputs, ``model(x)`` for a tensor."""
    if torch.is_tensor(x):
        return model(x, **extra)
    return model(**x, **extra)


def check_inputs(value: Any, name: str, entry: str) -> Inputs:
    """A tensor, or a dict of tensors that share dim 0 (returned as a ``Batch``, keys sorted).

    Raises:
        UserError: anything else, an empty input, tensors disagreeing on dim 0, or NaN/inf.
    """
    if value is None:
        raise UserError(
            f"task.data {entry} returned no {name!r}; return train_x, train_y, eval_x, eval_y (tensors or dicts of tensors)"
        )
    if torch.is_tensor(value):
        x: Inputs = value
    elif isinstance(value, Mapping) and value and all(torch.is_tensor(v) for v in value.values()):
        x = Batch(sorted((str(k), v) for k, v in value.items()))
        lengths = {k: v.shape[0] if v.ndim else None for k, v in x.items()}
        if len(set(lengths.values())) != 1 or None in lengths.values():
            shown = ", ".join(f"{k}: {n}" for k, n in lengths.items())
            raise UserError(
                f"task.data {entry}: the tensors of {name} disagree on their first dimension ({shown}); "
                f"give every tensor of a dict input one row per sample"
            )
    else:
        raise UserError(
            f"task.data {entry}: {name} is {type(value).__name__}; "
            "give a tensor or a dict of tensors sharing their first dimension"
        )
    for key, t in tensors_of(x).items():
        if t.ndim == 0 or t.shape[0] == 0:
            raise UserError(f"task.data {entry}: {name} is empty; the fixed set needs at least one sample")
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            where = f"{name}[{key!r}]" if key else name
            raise UserError(f"task.data {entry}: {where} holds NaN or inf; clean the data before freezing a reference")
    return x


# --- training data: tensors in memory, or a Dataset read item by item ---------------------------------


class TensorSource:
    """Training data held in memory."""

    def __init__(self, x: Inputs, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return rows(self.x)

    def batch(self, idx: torch.Tensor) -> tuple[Inputs, torch.Tensor]:
        return self.x[idx], self.y[idx]


class DatasetSource:
    """A map-style Dataset: item ``i`` is ``(x, y)``, or a dict of tensors holding the target under ``label_key``."""

    def __init__(self, dataset: Any, label_key: str, entry: str = "", kind: str | None = None) -> None:
        self.dataset, self.label_key, self.entry, self.kind = dataset, label_key, entry, kind

    def __len__(self) -> int:
        return len(self.dataset)

    def item(self, i: int) -> tuple[Inputs, torch.Tensor]:
        """Item ``i`` as (inputs, target), checked: finite floating values, and class targets that are integers.

        Raises:
            UserError: the Dataset raised on it (named with the exception), or the item is malformed.
        """
        try:
            item = self.dataset[int(i)]
        except UserError:
            raise
        except Exception as exc:  # noqa: BLE001 - the user's __getitem__: its failure is theirs to fix, named, without a traceback
            first = (str(exc).strip().splitlines() or [""])[0][:200]
            raise UserError(
                f"task.data {self.entry}: the training Dataset raised {type(exc).__name__} on item {int(i)}"
                + (f" ({first})" if first else "") + "; fix its __getitem__ for that index, then rerun"
            ) from None
        x, y = self._split(item, int(i))
        for key, t in tensors_of(x).items():
            if (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
                where = f"input {key!r}" if key else "its input"
                raise UserError(
                    f"task.data {self.entry}: training item {int(i)} holds NaN or inf in {where}; clean that item of the Dataset"
                )
        check_targets(y, self.kind, f"task.data {self.entry}: training item {int(i)}")
        return x, y

    def _split(self, item: Any, i: int) -> tuple[Inputs, torch.Tensor]:
        if isinstance(item, (tuple, list)) and len(item) == 2:
            x, y = item
        elif isinstance(item, Mapping):
            if self.label_key not in item:
                raise UserError(
                    f"task.data {self.entry}: training item {int(i)} has no {self.label_key!r} (task.label_key) among "
                    f"{sorted(item)}; put the target there or set task.label_key"
                )
            y = item[self.label_key]
            x = {k: v for k, v in item.items() if k != self.label_key}
        else:
            raise UserError(
                f"task.data {self.entry}: training item {int(i)} is {type(item).__name__}; "
                "return (x, y) or a dict with the target under task.label_key"
            )
        x = Batch(sorted(x.items())) if isinstance(x, Mapping) else x
        values = list(x.values()) if isinstance(x, Mapping) else [x]
        if not values or not all(torch.is_tensor(t) for t in values):
            raise UserError(
                f"task.data {self.entry}: training item {int(i)} holds inputs that are not tensors; "
                "return tensors (a tensor or a dict of tensors)"
            )
        return x, y if torch.is_tensor(y) else torch.tensor(y)

    def batch(self, idx: torch.Tensor) -> tuple[Inputs, torch.Tensor]:
        items = [self.item(i) for i in idx.tolist()]
        xs = [x for x, _ in items]
        first = tensors_of(xs[0])
        for x in xs[1:]:
            if {k: (t.shape, t.dtype) for k, t in tensors_of(x).items()} != {k: (t.shape, t.dtype) for k, t in first.items()}:
                raise UserError(
                    f"task.data {self.entry}: training items differ in input names, shapes or dtypes; pad them to one shape "
                    f"in the Dataset (a batch is stacked as is)"
                )
        return stack(xs), torch.stack([y for _, y in items])

    def fingerprint(self) -> str:
        """sha256 of a few items (first, middle, last): a changed Dataset is noticed before training on it."""
        digest = hashlib.sha256(str(len(self)).encode())
        for i in sorted({0, len(self) // 2, len(self) - 1}):
            x, y = self.item(i)
            for key, t in sorted({**tensors_of(x), "__target__": y}.items()):
                t = t.detach().cpu().contiguous()
                digest.update(f"{key}|{t.dtype}|{tuple(t.shape)}|".encode())
                digest.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return digest.hexdigest()


TrainSource = Union[TensorSource, DatasetSource]


@dataclass(frozen=True)
class FrozenDataset(Record):
    """What prepare records of a training Dataset (``DatasetSource``), checked again before training on it."""

    length: int
    fingerprint: str
    """``DatasetSource.fingerprint``."""


@dataclass(frozen=True)
class TrainHeader(Record):
    """The prepared training file's metadata: a Dataset's record, absent where the file holds the tensors."""

    ABSENT = ("dataset",)

    dataset: FrozenDataset | None = None


def save_train(path, source: TrainSource) -> str:
    """The prepared training data: the tensors themselves, or (a Dataset, maybe larger than memory) its
    length and fingerprint, checked again by ``load_train``. Returns the file's sha256."""
    if isinstance(source, TensorSource):
        return write_tensors(path, {**flatten(source.x, "x"), "y": source.y.contiguous()})
    n = len(source)
    header = TrainHeader(dataset=FrozenDataset(length=n, fingerprint=source.fingerprint()))
    return write_tensors(path, {"length": torch.tensor([n])}, header.as_dict())


def load_train(cfg: TaskConfig, path, expected_sha256: str | None = None) -> TrainSource:
    """The training data prepare froze: tensors from the file, or the data function's Dataset, verified.

    Raises:
        UserError: the file is missing or damaged, or the Dataset differs from the one prepare saw.
    """
    tensors, meta = read_tensors(path, expected_sha256, "prepare")
    try:
        frozen = TrainHeader.from_dict(meta).dataset
    except ValueError as exc:
        raise UserError(f"{path} is not a prepared training file of this version ({exc}); run `dvc repro prepare`") from None
    if frozen is None:
        return TensorSource(unflatten(tensors, "x"), tensors["y"])  # the file's tensor names (``save_train``)
    source = load_data(cfg).train
    if not isinstance(source, DatasetSource) or len(source) != frozen.length or source.fingerprint() != frozen.fingerprint:
        raise UserError(
            f"task.data {cfg.data}: the training Dataset differs from the one prepare recorded (length or items); its items "
            f"must be deterministic: run `dvc repro` to prepare again"
        )
    return source


def _is_dataset(value: Any) -> bool:
    return isinstance(value, torch.utils.data.Dataset) and not isinstance(value, torch.utils.data.IterableDataset)


@dataclass
class TaskData:
    train: TrainSource
    eval_x: Inputs
    eval_y: torch.Tensor
    eval_ids: list[str]
    edge_x: Inputs | None = None
    edge_ids: list[str] = field(default_factory=list)

    @property
    def train_x(self) -> Inputs:
        """The training inputs when they are held in memory (not for a Dataset)."""
        return self.train.x

    @property
    def train_y(self) -> torch.Tensor:
        return self.train.y


def resolve(entry: str, key: str) -> Callable[..., Any]:
    """Import ``module:function``.

    Raises:
        UserError: the module does not import or lacks the function.
    """
    module_name, _, func_name = entry.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UserError(
            f"params.yaml: {key} {entry!r}: module {module_name!r} does not import ({exc}); "
            f"check the name and that it is on PYTHONPATH"
        ) from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UserError(f"params.yaml: {key} {entry!r}: {module_name} has no function {func_name!r}; fix the name")
    return func


def entry_points(cfg: TaskConfig, optimizer: str = "") -> list[str]:
    """The ``module:function`` entries params names: model, data, and a custom loss, metric or optimizer."""
    names = [cfg.model, cfg.data, cfg.loss, cfg.metric, optimizer]
    return sorted({n for n in names if ":" in n})


def source_digest(entries: Iterable[str]) -> dict[str, str]:
    """sha256 of the source file of each entry's module (the code that builds the model and the data),
    by module name. A module without a source file (built in, compiled) is recorded as "no source file".

    Raises:
        UserError: a module does not import.
    """
    out: dict[str, str] = {}
    for entry in entries:
        module_name = entry.partition(":")[0]
        resolve(entry, "task")  # one line for a module that does not import
        origin = getattr(importlib.import_module(module_name), "__file__", None)
        if not origin:
            out[module_name] = "no source file"
            continue
        out[module_name] = sha256_file(origin)
    return out


def _split_targets(raw: dict, split: str, cfg: TaskConfig) -> tuple[Inputs, torch.Tensor]:
    """``{split}_x`` and ``{split}_y``; without ``{split}_y``, the target is taken from the dict input under label_key."""
    x = check_inputs(raw.get(f"{split}_x"), f"{split}_x", cfg.data)
    y = raw.get(f"{split}_y")
    if y is None:
        if torch.is_tensor(x) or cfg.label_key not in x:
            raise UserError(
                f"task.data {cfg.data} returned no {split}_y and {split}_x has no {cfg.label_key!r} (task.label_key); "
                f"return {split}_y, or put the targets in {split}_x under task.label_key"
            )
        y = x[cfg.label_key]
        x = Batch({k: v for k, v in x.items() if k != cfg.label_key})
    if not torch.is_tensor(y):
        raise UserError(f"task.data {cfg.data}: {split}_y is {type(y).__name__}; return the targets as a tensor")
    if y.ndim == 0 or y.shape[0] != rows(x):
        raise UserError(f"task.data {cfg.data}: {split}_x and {split}_y have different lengths; give one target per sample")
    check_targets(y, cfg.kind, f"task.data {cfg.data}: {split}_y")
    return x, y


def check_targets(y: torch.Tensor, kind: str | None, where: str) -> None:
    """Targets the loss can take as they are: never complex, NaN or inf; for classification, whole class numbers (a float
    target 2.7 would be truncated to class 2 by ``.long()``, silently).

    Raises:
        UserError: naming ``where``, what is wrong and the fix.
    """
    if y.is_complex():
        raise UserError(
            f"{where} is {str(y.dtype).replace('torch.', '')}: targets cannot be complex; "
            "give real targets (class numbers or values)"
        )
    if y.is_floating_point() and not bool(torch.isfinite(y).all()):
        raise UserError(f"{where} holds NaN or inf; clean the data before freezing a reference")
    if kind != "classification" or not y.is_floating_point():
        return
    whole = y == torch.round(y)
    if not bool(whole.all()):
        bad = float(y[~whole].reshape(-1)[0])
        raise UserError(
            f"{where}: class targets must be whole numbers, found {bad:g} ({str(y.dtype).replace('torch.', '')}); give class "
            f"indices (e.g. y.round().long() if they are classes, or set task.kind: regression)"
        )


def load_data(cfg: TaskConfig) -> TaskData:
    """Call the data function and check what it returns.

    Raises:
        UserError: a key is missing, an input is empty or non-finite, lengths disagree, or ids are not distinct.
    """
    raw = resolve(cfg.data, "task.data")(**cfg.options)
    if not isinstance(raw, dict):
        raise UserError(
            f"task.data {cfg.data} returned {type(raw).__name__}; return a dict with train_x, train_y, eval_x, eval_y"
        )
    if _is_dataset(raw.get("train_x")):
        train: TrainSource = DatasetSource(raw["train_x"], cfg.label_key, cfg.data, cfg.kind)
        if len(train) == 0:
            raise UserError(f"task.data {cfg.data}: the training Dataset is empty; give it at least one item")
    else:
        train = TensorSource(*_split_targets(raw, "train", cfg))
    eval_x, eval_y = _split_targets(raw, "eval", cfg)
    n_eval = rows(eval_x)
    ids = raw.get("eval_ids")
    ids = [f"sample-{i:05d}" for i in range(n_eval)] if ids is None else list(ids.tolist() if torch.is_tensor(ids) else ids)
    if len(ids) != n_eval or len(set(ids)) != n_eval:
        raise UserError(f"task.data {cfg.data}: eval_ids must be {n_eval} distinct strings, one per eval sample")
    edge_x, edge_ids = raw.get("edge_x"), [str(i) for i in raw.get("edge_ids") or []]
    if edge_x is not None:
        edge_x = check_inputs(edge_x, "edge_x", cfg.data)
        if len(edge_ids) != rows(edge_x) or len(set(edge_ids)) != len(edge_ids):
            raise UserError(f"task.data {cfg.data}: edge_ids must be {rows(edge_x)} distinct names, one per edge_x row")
        if _structure(edge_x) != _structure(eval_x):
            raise UserError(
                f"task.data {cfg.data}: edge_x {_structure(edge_x)} does not match eval_x {_structure(eval_x)}; "
                "give edge cases eval_x's names, shapes and dtypes"
            )
    return TaskData(train=train, eval_x=eval_x, eval_y=eval_y, eval_ids=[str(i) for i in ids], edge_x=edge_x, edge_ids=edge_ids)


def _structure(x: Inputs) -> dict:
    return {k: (tuple(t.shape[1:]), str(t.dtype).replace("torch.", "")) for k, t in tensors_of(x).items()}


def build_model(cfg: TaskConfig, seed: int) -> torch.nn.Module:
    """Seeded construction, so the initial weights are a function of ``seed`` alone."""
    torch.manual_seed(seed)
    model = resolve(cfg.model, "task.model")(**cfg.options)
    if not isinstance(model, torch.nn.Module):
        raise UserError(f"task.model {cfg.model} returned {type(model).__name__}; return a torch.nn.Module")
    weights = [t.dtype for t in model.parameters() if t.is_floating_point() and t.dtype != torch.float32]
    weights += [t.dtype for t in model.buffers() if t.dtype in (torch.float16, torch.bfloat16)]
    other = sorted({str(dtype).replace("torch.", "") for dtype in weights})
    if other:
        # A model already in bfloat16 (torch_dtype=torch.bfloat16, .half(), .to(...)) runs the same ops under every
        # policy: its "FP32 reference" would be the trial itself, and every trial an accept; one in float64 is no FP32
        # either, and autocast leaves float64 alone.
        raise UserError(
            f"task.model {cfg.model} returned a model with {' and '.join(other)} weights; the reference is the model in "
            "float32 and each trial sets its own precision: build it in float32 (no torch_dtype=..., .half() or "
            ".to(dtype); call .float() on it)"
        )
    return model


def named_outputs(result: Any, entry: str = "task.model") -> dict[str, torch.Tensor]:
    """A tensor, a dict of named tensors, a Hugging Face ``ModelOutput``, a tuple (named by position: ``0``, ``1``...; a
    named tuple by its fields), or an object with a tensor ``.logits``; always give a dict, sorted by name.

    A ``ModelOutput`` (any dataclass) gives every tensor head it returns: YOLOS's ``logits`` and ``pred_boxes``,
    CLIP's ``logits_per_image`` and embeddings (an untested head is no accept), less its losses and scalars and its
    inner states: what is not a tensor (caches, tuples of per-layer states, a sub-model's output) and, beside a
    head, hidden states (``heads.STATES``). A dict must hold tensors only (``loss`` and ``None`` left out).

    Raises:
        UserError: the model returned something else, or a field that is not a tensor.
    """
    if torch.is_tensor(result):
        return {DEFAULT_OUTPUT: result}
    if dataclasses.is_dataclass(result):
        # A ModelOutput is a dataclass. What is not a tensor in it is an inner state (a cache, per-layer tuples, a
        # sub-model's output), and so are its hidden states beside a head; a scalar is a statistic of the batch (a
        # MoE's aux_loss, a quantizer's perplexity), not an output per case.
        items = result.items() if isinstance(result, Mapping) else ((f.name, getattr(result, f.name))
                                                                    for f in dataclasses.fields(result))
        fields = {str(k): v for k, v in items if torch.is_tensor(v) and v.ndim > 0 and k != "loss"}
        fields = heads.inner_states(fields)
    elif isinstance(result, Mapping):
        fields = {str(k): v for k, v in result.items() if v is not None and k != "loss"}
    elif isinstance(result, (tuple, list)):
        # A plain tuple ((logits, features), Hugging Face's return_dict=False) is named by position, the first its
        # primary; a named tuple by its fields. What is not a tensor of one row per case is an inner state (a cache,
        # per-layer tuples) or a batch statistic (a loss), as in a ModelOutput.
        names = getattr(result, "_fields", None) or [str(i) for i in range(len(result))]
        fields = {str(k): v for k, v in zip(names, result) if torch.is_tensor(v) and v.ndim > 0}
    elif torch.is_tensor(getattr(result, "logits", None)):
        return {"logits": result.logits}
    else:
        raise UserError(
            f"{entry} returned {type(result).__name__} with no tensor and no .logits; return a tensor, a tuple, a dict of named "
            f"tensors, or an object with .logits"
        )
    return _tensors(fields, type(result).__name__, entry)


def _tensors(fields: dict[str, Any], what: str, entry: str) -> dict[str, torch.Tensor]:
    wrong = next((k for k, v in fields.items() if not torch.is_tensor(v)), None)
    if wrong is not None or not fields:
        said = f"whose field '{wrong}' is {type(fields[wrong]).__name__}, not a tensor" if wrong else "with no tensor"
        raise UserError(
            f"{entry} returned a {what} {said}; return a tensor or a dict of tensors (wrap the model to pick its outputs)"
        )
    return dict(sorted(fields.items()))


def primary(outputs: dict[str, torch.Tensor]) -> torch.Tensor:
    """The output that decisions and the loss are computed from (``heads.primary_name``)."""
    return outputs[primary_name(outputs)]


def check_outputs(outputs: dict[str, torch.Tensor], kind: str, rows: int, targets: torch.Tensor, entry: str) -> None:
    """Refuse outputs that cannot be compared or decided on, before any training is spent on them.

    Classification scores are [N, C] against targets [N], or per token [N, T, C] against [N, T];
    targets of -100 are ignored.

    Raises:
        UserError: wrong number of rows, classification scores of another shape, or targets out of range.
    """
    for name, value in outputs.items():
        if value.shape[:1] != (rows,):
            raise UserError(
                f"task.model {entry}: output '{name}' has shape {tuple(value.shape)} for a batch of {rows}; "
                "return one row per sample"
            )
        if not value.is_floating_point():
            raise UserError(f"task.model {entry}: output '{name}' is {value.dtype}; return floating-point scores or values")
    ambiguous = primary_by_order(outputs)
    if kind != "classification" and ambiguous:  # a classification's primary must be class scores: its shape is checked
        raise UserError(
            f"task.model {entry}: outputs {', '.join(repr(n) for n in ambiguous)} name no primary output (quality, "
            f"decisions and a built-in loss read it), and alphabetical order would pick '{ambiguous[0]}'; return the "
            f"prediction as 'output' (or name it ending in '_pred')"
        )
    scores = primary(outputs)
    if kind == "classification":
        per_token = scores.ndim == 3 and targets.ndim == 2 and tuple(targets.shape[1:]) == tuple(scores.shape[1:2])
        if not (scores.ndim == 2 and targets.ndim == 1 or per_token) or scores.shape[-1] < 2:
            raise UserError(
                f"task.model {entry}: classification needs scores of shape [N, classes>=2] for targets [N], or [N, T, classes] "
                f"for targets [N, T]; got scores {tuple(scores.shape)} for targets {tuple(targets.shape)}: return one score per "
                f"class, or set task.kind: regression"
            )
        valid = targets[targets != IGNORE_INDEX]
        if valid.numel() and (int(valid.min()) < 0 or int(valid.max()) >= scores.shape[-1]):
            raise UserError(
                f"task.data: targets range over {int(valid.min())}..{int(valid.max())} "
                f"but the model scores {scores.shape[-1]} classes; "
                "make them agree"
            )
    elif scores.reshape(rows, -1).shape[1] != targets.reshape(targets.shape[0], -1).shape[1]:
        raise UserError(
            f"task.model {entry}: output has {scores.reshape(rows, -1).shape[1]} value(s) per sample "
            f"but targets have {targets.reshape(targets.shape[0], -1).shape[1]}; make them agree"
        )


def rows_within(elements: int, per_row: int) -> int:
    """How many rows of ``per_row`` elements one slice of at most ``elements`` holds (at least one row)."""
    return max(1, elements // max(1, per_row))


def iter_rows(x: Inputs, batch_size: int) -> Iterable[tuple[int, int, Inputs]]:
    """(start, stop, rows) chunks of ``x`` in order."""
    n = rows(x)
    for start in range(0, n, batch_size):
        yield start, min(start + batch_size, n), x[start : start + batch_size]


FLOAT32_EXACT_WHOLE = 2**24
"""Whole numbers from here on are not all exact in float32, the dtype outputs are recorded in (2**24 + 1 rounds to
2**24), and every float32 there is whole."""


DECODER_INPUTS = ("decoder_input_ids", "decoder_inputs_embeds", "decoder_attention_mask")
"""Inputs of an encoder-decoder's decoder (Hugging Face's names): its per-token outputs are the decoder's positions."""


def token_mask_of(x) -> torch.Tensor | None:
    """The padding mask [N, T] of the per-token outputs of dict inputs (Hugging Face's names), if any: positions where it
    is 0 are padding. An encoder-decoder's outputs are its decoder's (``DECODER_INPUTS``): their mask is the
    ``decoder_attention_mask``, or none (its targets' -100 then say where padding is), never the ``attention_mask``,
    which is the encoder's, even where padding both to one ``max_length`` gives it the decoder's length. Else the
    ``attention_mask``."""
    if not isinstance(x, dict):
        return None
    key = "decoder_attention_mask" if any(k in x for k in DECODER_INPUTS) else "attention_mask"
    mask = x.get(key)
    return mask if torch.is_tensor(mask) and mask.ndim == 2 else None


def masked_targets(targets: torch.Tensor, token_mask: torch.Tensor | None) -> torch.Tensor:
    """Per-token targets with the padding positions of ``token_mask`` (``token_mask_of``) ignored (-100). Floating
    targets [N, T] that hold a value other than 0 or -100 at a padding position are no per-token targets: the labels
    of a multi-label head whose L happens to equal the sequence's T are columns, returned as they are."""
    if token_mask is not None and tuple(token_mask.shape) == tuple(targets.shape) and targets.ndim == 2:
        padding = targets[~token_mask.bool()]
        if targets.is_floating_point() and not bool(((padding == 0) | (padding == IGNORE_INDEX)).all()):
            return targets
        return targets.masked_fill(~token_mask.bool(), IGNORE_INDEX)
    return targets


def binary_targets(targets: torch.Tensor, has_target: torch.Tensor) -> bool:
    """Whether the targets of the cases that have one (less the ignored positions, -100) are labels, every one 0 or 1,
    and there is at least one: a regression's logits or probabilities are then a sigmoid's decisions (multi-label, one
    logit), where Hugging Face's regression head, also named ``logits``, holds values."""
    known = targets[has_target.bool()]
    known = known[known != IGNORE_INDEX]
    return bool(known.numel()) and bool(((known == 0) | (known == 1)).all())


def labelled_positions(shape: tuple[int, ...], targets: torch.Tensor, judged: torch.Tensor | None) -> torch.Tensor | None:
    """Where a regression's primary holds a value per position (``shape`` [N, T, ...] against targets [N, T, ...]; [N, T]
    where ``judged_positions`` says it is per position): the positions [N, T] its decisions and quality count, those
    ``judged`` whose target is not -100 (ignored, as Hugging Face ignores a word's continuation sub-words or a special
    token: its value is still judged, no decision or error is read there). None: the output is not per position."""
    if (targets.ndim < 2 or len(shape) < 2 or tuple(shape[:2]) != tuple(targets.shape[:2])
            or (len(shape) == 2 and judged is None)):
        return None
    keep = (targets != IGNORE_INDEX).reshape(*targets.shape[:2], -1).all(-1)
    return keep if judged is None else keep & judged


def scores_over_positions(shape: tuple[int, ...], targets: torch.Tensor, has_target: torch.Tensor,
                          token_mask: torch.Tensor | None) -> torch.Tensor | None:
    """Where a classification's primary of ``shape`` [N, T] holds scores over the batch's positions, not over T classes
    (an extractive QA head's ``start_logits`` / ``end_logits``: its decision is the answer's boundary among the real
    tokens, as Hugging Face's QA pipeline reads it, never a padding position): the real positions [N, T] it is read over
    (``token_mask``'s; a row without any keeps all), its padding at -inf (``mask_padding``); else None, read over every
    column.

    The signal: scores [N, T] whose T is the token mask's length, against one integer target per case (a position),
    where every case that has a target (not -100) and padding holds its target at a real position of its own, and at
    least one such case exists (without one, both readings agree on the targets, and the columns are kept: the reading
    of old). Shapes and targets alone cannot tell a classifier of as many classes as the padded length whose padded
    cases' labels lie within their lengths: ``streams.position_heads`` asks the head's name too. Per-token scores
    [N, T, C], a value per position [N, T] against targets [N, T] and a multi-label head [N, L] (targets [N, L]) have
    no such targets and are not read so."""
    if (len(shape) != 2 or token_mask is None or tuple(token_mask.shape) != tuple(shape) or targets.ndim != 1
            or targets.is_floating_point() or targets.shape[0] != shape[0]):
        return None
    real = token_mask.bool()
    padded = has_target.bool() & (targets != IGNORE_INDEX) & ~real.all(1)  # the cases whose target tells the readings apart
    y = targets[padded].long()
    if not y.numel() or bool(((y < 0) | (y >= shape[1])).any()):
        return None
    if not bool(real[padded].gather(1, y[:, None]).all()):
        return None
    return real | ~real.any(1, keepdim=True)


def mask_padding(scores: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Scores over positions [n, T] (``scores_over_positions``) with their padding (``real`` False) at -inf: probability
    0, a position no decision is read at, whose pairs agree as a masked class's do (``gaps.GapStats``)."""
    return scores.masked_fill(~real.to(scores.device), float("-inf"))


def judged_positions(shape: tuple[int, ...], primary_per_token: bool, targets: torch.Tensor,
                     token_mask: torch.Tensor | None, primary: bool = False) -> torch.Tensor | None:
    """The positions [N, T] of a per-token output of ``shape`` [N, T, ...] whose values and finiteness are judged (at
    freeze and in compare): those the batch's ``token_mask`` keeps, when it has one of that length (padding is no output
    the application uses; a real position whose target is -100, a sequence's last, which generation reads next, is
    one); else, for the per-token primary, those with a target (without a mask, -100 is all that is known of padding;
    a regression's primary [N, T, ...] too, its targets [N, T], where some are -100); None: every position counts (an
    output that is not per token, or no mask for another output). The ``primary`` output squeezed to [N, T] (a
    regression per token returns a value per position so) is per token where its targets are [N, T], the mask has
    their shape and ``masked_targets`` read its padding as such; any other [N, D] output is columns, judged whole (an
    embedding of T dimensions, a multi-label head of T labels, readings of -100 dBm, cannot be told from T positions
    by their shape: judging padding is the safe side)."""
    positions = primary and targets.ndim == 2 and tuple(targets.shape) == tuple(shape[:2])  # targets [N, T]
    if len(shape) == 2:  # positions where the mask has their shape and ``masked_targets`` ignored its padding
        masked = positions and token_mask is not None and tuple(token_mask.shape) == tuple(shape)
        return token_mask.bool() if masked and bool((targets[~token_mask.bool()] == IGNORE_INDEX).all()) else None
    if len(shape) != 3:
        return None
    if token_mask is not None and token_mask.ndim == 2 and token_mask.shape[1] == shape[1]:
        return token_mask.bool()
    if primary_per_token or (positions and bool((targets == IGNORE_INDEX).any())):
        return targets != IGNORE_INDEX
    return None
