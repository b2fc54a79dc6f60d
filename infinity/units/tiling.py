"""Memory-centric tiling: a Linear or Embedding larger than `[units] tile_bytes` runs as tiles of its rows.

Note [tiles are units]: a unit is the engine's unit of fetch and release, so a layer larger than the
device can hold cannot be one. Before units are formed, `tile_layers` replaces every nn.Linear whose
parameters (weight and bias, in the compute dtype) exceed `tile_bytes` by a `TiledLinear`: k plain
nn.Linear tiles over consecutive output rows, each at most `tile_bytes`, whose outputs are concatenated
on the last dimension (the bias is split with its rows). Row i of the output reads row i of the weight
alone, so the concatenation equals the untiled layer bit for bit on the CPU (the same dot products), and
the gradients are the untiled ones' row ranges. Each tile is its own unit (`find_unit_modules`), and a
block that holds a tiled layer is not one unit but split into its children (the units that do not nest),
so the existing hooks fetch a tile before its forward, release it after, fetch it again before its
backward and release it once its gradient is taken and reduced: a unit's device working memory is about
two tiles (one computing, one prefetched), whatever the layer. The tiles' row ranges are contiguous element
ranges of the untiled weight (row-major) and bias, so `Tiling` maps each tile parameter to (origin name,
element offset): state dicts, checkpoint exports and `weights=` speak the untiled names; a checkpoint
records the tiling and refuses a run tiled otherwise. A Linear tied to another module (an output head
sharing the embedding) is never tiled: its parameter is one value under two names.

An nn.Embedding (a large vocabulary's input table) tiles the same way, over consecutive rows of its table:
`TiledEmbedding` gives each tile the token ids in its row range (shifted to the tile's first row; others
clamped into range and their looked-up rows replaced by zeros) and sums the tiles' outputs, so every output
row is the untiled lookup exactly (one nonzero term, the rest +0.0) and each tile's gradient holds its rows'
contributions alone; a tile holding `padding_idx` keeps it (shifted), so that row still gets no gradient.
Embeddings with `max_norm`, `sparse` or `scale_grad_by_freq` are not tiled (they renormalize or scale over
the whole table), nor is one tied to another module.

With `[activation] checkpoint = "units"` a split block is checkpointed whole (`split_regions`; activations.py),
not unit by unit: otherwise what runs between its units (attention, the activation function on the
concatenated output, residual adds) would be checkpointed by nothing and keep its saved tensors (a 1T
model's block kept 4.3 GiB that way). Its recomputation in backward fires its units' hooks (Note
[recomputed forward] in runtime/hooks.py): a unit it has to fetch (SHARDED) is fetched without prefetching
and released after its recomputed forward, and its backward fetches it again, so a recomputation also holds
one tile at a time; each tile's parameters are fetched three times per micro-batch instead of two, but for the
block's last `units_ahead + 1`, which its backward holds or prefetched when the recomputation starts
(`recomputed_units`; the byte model's `UnitSizes.fetches`, and one more unit gathered in its working memory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from infinity.config.options import ConfigError


class TiledLinear(nn.Module):
    """An nn.Linear as consecutive row tiles (`tiles[i]` computes output features [start_i, end_i))."""

    def __init__(self, tiles: list[nn.Linear], in_features: int, out_features: int):
        super().__init__()
        self.tiles = nn.ModuleList(tiles)
        self.in_features, self.out_features = in_features, out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([tile(x) for tile in self.tiles], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tiles={len(self.tiles)}"

    @staticmethod
    def accepts(linear: nn.Linear) -> bool:
        return True

    @staticmethod
    def rows_of(linear: nn.Linear) -> tuple[int, int]:
        """(rows, elements per row): its outputs, each with its inputs' weights and the bias."""
        return linear.out_features, linear.in_features + (linear.bias is not None)

    @classmethod
    def split(cls, linear: nn.Linear, rows: int) -> "TiledLinear":
        """`linear` as tiles of `rows` output rows (the last may be fewer)."""
        tiles = [_tile_params(linear, nn.Linear(linear.in_features, min(rows, linear.out_features - start),
                                                bias=linear.bias is not None, device="meta"),
                              start, min(start + rows, linear.out_features))
                 for start in range(0, linear.out_features, rows)]
        return cls(tiles, linear.in_features, linear.out_features)


class TiledEmbedding(nn.Module):
    """An nn.Embedding as consecutive row tiles (`tiles[i]` holds rows [starts[i], starts[i] + its rows))."""

    def __init__(self, tiles: list[nn.Embedding], num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.tiles = nn.ModuleList(tiles)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.starts = [sum(t.num_embeddings for t in tiles[:i]) for i in range(len(tiles))]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = None
        for start, tile in zip(self.starts, self.tiles):
            local = ids - start
            inside = ((local >= 0) & (local < tile.num_embeddings)).unsqueeze(-1)
            rows = torch.where(inside, tile(local.clamp(0, tile.num_embeddings - 1)), 0.0)
            out = rows if out is None else out + rows
        return out

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tiles={len(self.tiles)}"

    @staticmethod
    def accepts(emb: nn.Embedding) -> bool:
        """Not one that renormalizes or scales over the whole table."""
        return emb.max_norm is None and not emb.sparse and not emb.scale_grad_by_freq

    @staticmethod
    def rows_of(emb: nn.Embedding) -> tuple[int, int]:
        """(rows, elements per row) of its table."""
        return emb.num_embeddings, emb.embedding_dim

    @classmethod
    def split(cls, emb: nn.Embedding, rows: int) -> "TiledEmbedding":
        """`emb` as tiles of `rows` table rows; the one holding `padding_idx` keeps it, shifted to its rows."""
        tiles = []
        for start in range(0, emb.num_embeddings, rows):
            end = min(start + rows, emb.num_embeddings)
            pad = emb.padding_idx - start if emb.padding_idx is not None and start <= emb.padding_idx < end else None
            tiles.append(_tile_params(emb, nn.Embedding(end - start, emb.embedding_dim, padding_idx=pad,
                                                        device="meta"), start, end))
        return cls(tiles, emb.num_embeddings, emb.embedding_dim)


_TILED_OF = {nn.Linear: TiledLinear, nn.Embedding: TiledEmbedding}  # the one answer to "how is this layer tiled"
TILED = tuple(_TILED_OF.values())  # the tiled layers: each of their `tiles` is a unit


@dataclass(frozen=True)
class TilePart:
    """What a tile's parameter is of its untiled parameter: elements [start, start + numel) of it, flattened."""

    origin: str
    start: int
    numel: int


@dataclass
class Tiling:
    """The tiles of one model: each tile parameter's part of its untiled parameter, and the untiled names."""

    tile_bytes: int = 0
    parts: dict[str, TilePart] = field(default_factory=dict)  # tile parameter name -> its part
    origins: dict[str, tuple[tuple[int, ...], list[str]]] = field(default_factory=dict)  # name -> (shape, tiles)
    keys: list[str] = field(default_factory=list)  # the untiled model's state_dict keys, in order

    def origin_name(self, name: str) -> str:
        part = self.parts.get(name)
        return part.origin if part is not None else name

    def by_tile(self, of_origin: dict[str, int]) -> dict[str, int]:
        """`of_origin` (keyed by untiled parameter names) with each tile parameter given its origin's value."""
        return of_origin | {t: of_origin[p.origin] for t, p in self.parts.items() if p.origin in of_origin}

    def state_dict_keys(self, model: nn.Module) -> list[str]:
        """The untiled model's `state_dict()` keys, in its order."""
        return list(self.keys) if self.parts else list(model.state_dict(keep_vars=True).keys())

    def untile(self, values: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A state dict with tiles' keys (`values`, in any order) as the untiled model's, in its key order: each
        tiled parameter is its tiles' values concatenated (rows, in order)."""
        if not self.parts:
            return values
        out = {}
        for key in self.keys:
            if key in self.origins:
                shape, tiles = self.origins[key]
                out[key] = torch.cat([values[t].reshape(-1) for t in tiles]).view(shape)
            else:
                out[key] = values[key]
        return out

    def record(self) -> dict:
        """What a checkpoint keeps of the tiling: the size and each tiled parameter's shape and tiles."""
        origins = {k: {"shape": list(shape), "tiles": list(tiles)} for k, (shape, tiles) in self.origins.items()}
        return {"tile_bytes": self.tile_bytes, "origins": origins}


def _tied(model: nn.Module) -> set[int]:
    """ids of the modules whose parameter another module also holds (never tiled)."""
    holders: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                holders[id(p)] = holders.get(id(p), 0) + 1
    return {id(m) for m in model.modules()
            if any(holders[id(p)] > 1 for p in m._parameters.values() if p is not None)}


def _tile_params(layer: nn.Module, tile: nn.Module, start: int, end: int) -> nn.Module:
    """`tile` (built on meta) given rows [start, end) of `layer`'s parameters (real values are copied, meta ones
    stay meta; same dtype)."""
    for attr, value in layer._parameters.items():
        if value is None:
            continue
        part = value.detach()[start:end] if value.device.type != "meta" else \
            torch.empty((end - start,) + tuple(value.shape[1:]), dtype=value.dtype, device="meta")
        tile._parameters[attr] = nn.Parameter(part.clone() if part.device.type != "meta" else part,
                                              requires_grad=value.requires_grad)
    return tile


def tile_layers(model: nn.Module, tile_bytes: int, itemsize: int, keep: tuple[nn.Module, ...] = ()) -> Tiling:
    """Replace, in place, every untied nn.Linear and nn.Embedding of `model` whose parameters exceed `tile_bytes`
    (at `itemsize` bytes per element) by a TiledLinear / TiledEmbedding of tiles of at most `tile_bytes` (Note
    [tiles are units]), except the modules in `keep` (a head the chunked loss reads whole). Returns the map
    from tile parameters to the untiled ones; nothing happens with tile_bytes = 0."""
    tiling = Tiling(tile_bytes=tile_bytes)
    if tile_bytes <= 0:
        return tiling
    keys = list(model.state_dict(keep_vars=True).keys())
    tied = _tied(model) | {id(m) for m in keep}
    targets = [(name, m) for name, m in model.named_modules()  # (a PEFT layer's base_layer is its own to read)
               if type(m) in _TILED_OF and _TILED_OF[type(m)].accepts(m) and id(m) not in tied
               and not name.endswith("base_layer")]
    for name, layer in targets:
        tiled_type = _TILED_OF[type(layer)]
        total_rows, per_row = tiled_type.rows_of(layer)
        row_bytes = per_row * itemsize
        if row_bytes * total_rows <= tile_bytes:
            continue
        if row_bytes > tile_bytes:
            raise ConfigError(f"[units] tile_bytes = {tile_bytes} is less than one row of {name} "
                             f"({per_row} elements: {row_bytes} bytes), the smallest tile: set tile_bytes "
                             f"to at least {row_bytes} (or 0 to turn tiling off)")
        rows = tile_bytes // row_bytes
        k = math.ceil(total_rows / rows)
        rows = math.ceil(total_rows / k)  # k tiles of (nearly) equal rows, each within tile_bytes
        tiled = tiled_type.split(layer, rows)
        parent_name, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent_name), attr, tiled)
        for pattr in ("weight", "bias"):
            origin = f"{name}.{pattr}"
            value = getattr(layer, pattr, None)
            if value is None:
                continue
            per_row = value[0].numel() if value.dim() > 1 else 1
            names = []
            for i, tile in enumerate(tiled.tiles):
                tile_name = f"{name}.tiles.{i}.{pattr}"
                part = getattr(tile, pattr)
                tiling.parts[tile_name] = TilePart(origin, i * rows * per_row, part.numel())
                names.append(tile_name)
            tiling.origins[origin] = (tuple(value.shape), names)
    if tiling.parts:
        tiling.keys = keys
    return tiling


def contains_tiles(module: nn.Module) -> bool:
    return any(isinstance(m, TILED) for m in module.modules())
