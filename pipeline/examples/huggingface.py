"""Hugging Face adapter: any ``transformers`` architecture, from a config (random init, nothing downloaded)
or from a local directory (``from_pretrained(path)``, offline), plus seeded token and image data.

Needs the optional extra: ``pip install 'amp-validation[hf]'`` (``transformers``).

The model is called as Hugging Face models are, ``model(**batch)`` with ``input_ids``, ``attention_mask``
(or ``pixel_values``), and returns a ``ModelOutput``: the pipeline compares every head it returns (``task.named_outputs``). With
``task.loss: model`` the targets are passed as ``labels=...`` and the model's own ``.loss`` is trained.

    task:
      model: pipeline.examples.huggingface:build_model
      data: pipeline.examples.huggingface:load_token_data
      loss: model                      # BERT's own cross-entropy; or cross_entropy on the logits
      options:
        architecture: BertForSequenceClassification
        config: {model_type: bert, vocab_size: 65, hidden_size: 32, num_hidden_layers: 2,
                 num_attention_heads: 2, intermediate_size: 64, max_position_embeddings: 64, num_labels: 4}

``pretrained: /path/to/dir`` loads weights saved by ``save_pretrained`` instead (``config`` then overrides
nothing; the directory's config is used). Nothing is ever fetched from the network, only safetensors weights
are read (``use_safetensors=True``: a pickled ``pytorch_model.bin`` is refused, never unpickled) and no code
from the directory runs (``trust_remote_code=False``).
"""

from __future__ import annotations

import torch

from pipeline.errors import UserError
from pipeline.examples import transformer


def _transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("task.model needs the transformers package: pip install 'amp-validation[hf]' (or transformers)") from None
    return transformers


def build_model(
    architecture: str = "BertForSequenceClassification",
    config: dict | None = None,
    pretrained: str | None = None,
    **_: object,
) -> torch.nn.Module:
    """``architecture`` is a class name of ``transformers`` (``BertForSequenceClassification``,
    ``ResNetForImageClassification``, ``GPT2LMHeadModel``...).

    Args:
        architecture: the model class.
        config: keyword arguments of its config, with ``model_type`` (``bert``, ``resnet``, ``gpt2``...);
            weights are randomly initialised from the global seed the pipeline sets.
        pretrained: a local directory written by ``save_pretrained``; read offline, never downloaded.

    Raises:
        UserError: an unknown architecture or model_type, or neither config nor pretrained.
    """
    hf = _transformers()
    cls = getattr(hf, architecture, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise UserError(
            f"task.options.architecture {architecture!r} is not a transformers model class; e.g. BertForSequenceClassification"
        )
    if pretrained:
        return _from_pretrained(cls, pretrained)
    if not config or "model_type" not in config:
        raise UserError(
            "task.options.config needs model_type (e.g. bert) and the sizes, or give task.options.pretrained: a local directory"
        )
    options = dict(config)
    model_type = options.pop("model_type")
    try:
        hf_config = hf.AutoConfig.for_model(model_type, **options)
    except ValueError as exc:
        raise UserError(f"task.options.config: {str(exc).splitlines()[0][:200]}; use a model_type transformers knows") from None
    return cls(hf_config)


SAFE_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")
PICKLED_WEIGHTS = (
    "pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth", "tf_model.h5", "flax_model.msgpack"
)


def _from_pretrained(cls, pretrained: str) -> torch.nn.Module:
    """``cls.from_pretrained`` on a local directory: safetensors weights only, no remote code, offline.

    Raises:
        UserError: not a directory, no safetensors weights in it (only a pickle), or transformers refuses it.
    """
    from pathlib import Path

    folder = Path(pretrained)
    if not folder.is_dir():
        raise UserError(f"task.options.pretrained {pretrained!r} is not a directory; give a folder written by save_pretrained")
    if not any((folder / name).is_file() for name in SAFE_WEIGHTS):
        found = [name for name in PICKLED_WEIGHTS if (folder / name).is_file()]
        what = f"only {', '.join(found)} (pickled weights, never loaded here)" if found else "no model.safetensors"
        raise UserError(
            f"task.options.pretrained {pretrained}: {what}; re-save the model with "
            f"model.save_pretrained({str(folder)!r}, safe_serialization=True), then rerun"
        )
    _check_shards(folder, pretrained)
    try:
        return cls.from_pretrained(folder, local_files_only=True, use_safetensors=True, trust_remote_code=False)
    except (OSError, ValueError, KeyError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise UserError(
            f"task.options.pretrained {pretrained}: transformers cannot load it ({first}); re-save it with save_pretrained"
        ) from None


def _check_shards(folder, pretrained: str) -> None:
    """A sharded checkpoint's index (``model.safetensors.index.json``) names safetensors shards inside ``folder`` only:
    its name alone does not make its shards safe (transformers loads the files its ``weight_map`` names, a pickled
    ``.bin`` included, and a path may leave the folder).

    Raises:
        UserError: the index is not a JSON object with a ``weight_map`` of shard names, or names a shard that is not a
            ``.safetensors`` file in the folder.
    """
    import json

    index = folder / "model.safetensors.index.json"
    if not index.is_file():
        return
    try:
        shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UserError(f"task.options.pretrained {pretrained}: {index.name} is not a sharded checkpoint's index "
                        f"({type(exc).__name__}); re-save the model with save_pretrained(..., safe_serialization=True)") from None
    bad = sorted(str(name) for name in shards if not (isinstance(name, str) and name.endswith(".safetensors")
                                                      and (folder / name).resolve().parent == folder.resolve()))
    if bad:
        raise UserError(f"task.options.pretrained {pretrained}: {index.name} maps weights to {bad[0]!r}, not a safetensors "
                        f"shard in the folder (pickled or outside weights are never loaded here); re-save the model with "
                        f"save_pretrained(..., safe_serialization=True)")


def load_token_data(
    n_train: int = 512,
    n_eval: int = 128,
    seq_len: int = 16,
    vocab: int = 64,
    classes: int = 4,
    max_padding: int = 4,
    data_seed: int = 0,
    **_: object,
) -> dict:
    """The marker-counting sequences of ``pipeline.examples.transformer`` as a tokenizer would give them:
    ``input_ids`` (int64) and ``attention_mask``. Each sequence is followed by extra filler tokens (never
    a marker: the label is unchanged) and then 0 to ``max_padding`` padding tokens (id ``vocab``, mask 0:
    the model's vocab_size must be at least ``vocab + 1``), so real lengths vary. Targets are the labels.
    One named edge case: a sequence of padding behind a single marker token."""
    raw = transformer.load_data(
        n_train=n_train, n_eval=n_eval, seq_len=seq_len, vocab=vocab, classes=classes, data_seed=data_seed
    )
    tokens = torch.cat([raw["train_x"], raw["eval_x"]])
    n, width = tokens.shape[0], seq_len + max_padding
    gen = torch.Generator().manual_seed(data_seed + 1)
    pads = torch.randint(0, max_padding + 1, (n,), generator=gen)
    filler = torch.randint(classes, vocab, (n, max_padding), generator=gen)
    ids = torch.cat([tokens, filler], dim=1)
    positions = torch.arange(width).unsqueeze(0)
    mask = (positions < (width - pads).unsqueeze(1)).long()
    ids = torch.where(mask.bool(), ids, torch.full_like(ids, vocab))
    labels = torch.cat([raw["train_y"], raw["eval_y"]])
    batch = {"input_ids": ids, "attention_mask": mask}
    return {
        "train_x": {k: v[:n_train] for k, v in batch.items()},
        "train_y": labels[:n_train],
        "eval_x": {k: v[n_train:] for k, v in batch.items()},
        "eval_y": labels[n_train:],
        "eval_ids": raw["eval_ids"],
        "edge_x": {
            "input_ids": torch.full((1, width), vocab, dtype=torch.long).index_fill_(1, torch.tensor([0]), 0),
            "attention_mask": (positions < 1).long(),
        },
        "edge_ids": ["one-marker-token"],
    }


def load_tagging_data(
    n_train: int = 512,
    n_eval: int = 128,
    seq_len: int = 16,
    vocab: int = 64,
    classes: int = 4,
    max_padding: int = 4,
    data_seed: int = 0,
    **_: object,
) -> dict:
    """Per-token classification (``BertForTokenClassification``, scores [N, T, C]): the sequences of
    ``load_token_data``, each token labelled with its marker class, or ``classes`` for filler tokens;
    padding is labelled -100 (ignored by the loss and the comparison's quality, as Hugging Face does).
    ``num_labels`` must be ``classes + 1``."""
    data = load_token_data(n_train, n_eval, seq_len, vocab, classes, max_padding, data_seed)
    for split in ("train", "eval"):
        ids, mask = data[f"{split}_x"]["input_ids"], data[f"{split}_x"]["attention_mask"]
        tags = torch.where(ids < classes, ids, torch.full_like(ids, classes))
        data[f"{split}_y"] = torch.where(mask.bool(), tags, torch.full_like(ids, -100))
    return data


def load_image_data(eval_fraction: float = 0.25, split_seed: int = 0, **_: object) -> dict:
    """scikit-learn's bundled 8x8 digits as ``pixel_values`` [N, 1, 8, 8] (for ``ResNetForImageClassification``
    with ``num_channels: 1``, ``num_labels: 10``), the inputs Hugging Face image models take."""
    from pipeline.examples import convnet

    data = convnet.load_data(eval_fraction, split_seed)
    return {**data, "train_x": {"pixel_values": data["train_x"]}, "eval_x": {"pixel_values": data["eval_x"]}}
