"""One mesh for every parallel dimension: pipeline stages × data replicas × sequence shards.

    world = pp · dp · sp ranks, laid out row-major over ("pp", "dp", "sp") (sp varies
    fastest), as `torch.distributed.device_mesh.init_device_mesh` lays out a mesh with
    those dim names, or as a user's DeviceMesh says.

    pp   pipeline stages: point-to-point activations and gradients between stage peers
         that share the same (dp, sp) coordinate
    dp   data replicas: each takes its share of every micro-batch's sequences
    sp   sequence shards (Ulysses): each takes its share of every chunk's tokens; the
         all-to-alls around attention run in the sp group
    dp × sp   the "replica group" of a stage: loss partials and parameter gradients are
         SUM-reduced over it

Every lookup of a peer goes through this object (no code computes rank ± 1), so a
different layout of the same dims changes nothing else (docs/architecture.md, section 3b
"Parallel layout and sequence parallelism").
"""
from __future__ import annotations

import dataclasses
import datetime

import torch.distributed as dist

from sppo_fx.errors import SppoError

DIMS = ("pp", "dp", "sp")


@dataclasses.dataclass(frozen=True)
class Layout:
    """Sizes of the parallel dims.

    Attributes:
        pp: pipeline stages P.
        dp: data-parallel replicas D.
        sp: sequence-parallel ranks S per stage.
    """

    pp: int = 1
    dp: int = 1
    sp: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.sp

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def __str__(self) -> str:
        return f"pp={self.pp} × dp={self.dp} × sp={self.sp}"


class ParallelMesh:
    """This rank's place in the layout, its peers and its process groups.

    Args:
        layout: the sizes.
        rank: this process's global rank.
        ranks: global rank at every (pp, dp, sp) coordinate (nested lists); default
            row-major over the world.
        timeout_s: timeout of the groups this mesh creates.
    """

    def __init__(self, layout: Layout, rank: int, ranks=None, timeout_s: float = 60.0):
        self.layout, self.rank = layout, rank
        if ranks is None:
            ranks = [[[(p * layout.dp + d) * layout.sp + s for s in range(layout.sp)]
                      for d in range(layout.dp)] for p in range(layout.pp)]
        self.ranks = ranks
        found = [(p, d, s) for p in range(layout.pp) for d in range(layout.dp) for s in range(layout.sp)
                 if ranks[p][d][s] == rank]
        if len(found) != 1:
            raise SppoError(f"rank {rank} is not in the mesh {layout}")
        self.pp_rank, self.dp_rank, self.sp_rank = found[0]
        self.timeout_s = timeout_s
        self._sp_group = self._replica_group = None

    @classmethod
    def from_device_mesh(cls, mesh, timeout_s: float = 60.0) -> "ParallelMesh":
        """A mesh from a user's DeviceMesh whose dims are named among "pp", "dp", "sp"
        (missing dims have size 1)."""
        cls.layout_of(mesh)  # checks the names
        names = tuple(mesh.mesh_dim_names)
        grid = mesh.mesh
        # bring the dims into (pp, dp, sp) order, adding size-1 dims for missing ones
        for name in DIMS:
            if name not in names:
                grid = grid.unsqueeze(-1)
                names = names + (name,)
        grid = grid.permute(*[names.index(n) for n in DIMS])
        layout = Layout(*grid.shape)
        return cls(layout, dist.get_rank(), grid.tolist(), timeout_s)

    @staticmethod
    def layout_of(mesh) -> Layout:
        """The Layout of a DeviceMesh whose dims are named among "pp", "dp", "sp"."""
        names = tuple(mesh.mesh_dim_names or ())
        unknown = [n for n in names if n not in DIMS]
        if not names or unknown:
            raise SppoError(f"mesh dims {names}: name every dim 'pp', 'dp' or 'sp' "
                            "(init_device_mesh(..., mesh_dim_names=('pp', 'dp', 'sp')))")
        sizes = dict(zip(names, mesh.mesh.shape))
        return Layout(*(int(sizes.get(n, 1)) for n in DIMS))

    def stage_rank(self, stage: int) -> int:
        """The global rank of `stage`'s peer with this rank's (dp, sp) coordinate."""
        return self.ranks[stage][self.dp_rank][self.sp_rank]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def replica_index(self) -> int:
        """This rank's index in its replica group (dp × sp, sp fastest)."""
        return self.dp_rank * self.layout.sp + self.sp_rank

    def create_groups(self) -> None:
        """Create the sp groups and the replica (dp × sp) groups. Collective: every rank
        of the world calls it, in the same order."""
        L = self.layout
        timeout = datetime.timedelta(seconds=self.timeout_s)
        if L.sp > 1:
            for p in range(L.pp):
                for d in range(L.dp):
                    g = dist.new_group(self.ranks[p][d], timeout=timeout)
                    if (p, d) == (self.pp_rank, self.dp_rank):
                        self._sp_group = g
        if L.dp * L.sp > 1:
            for p in range(L.pp):
                members = [r for row in self.ranks[p] for r in row]
                g = dist.new_group(members, timeout=timeout)
                if p == self.pp_rank:
                    self._replica_group = g

    @property
    def sp_group(self):
        """The process group of this rank's sequence shards (None when sp == 1)."""
        return self._sp_group

    @property
    def replica_group(self):
        """The process group over dp × sp of this rank's stage (None when both are 1)."""
        return self._replica_group

    def __repr__(self) -> str:
        return (f"ParallelMesh({self.layout}, rank {self.rank} at pp={self.pp_rank} dp={self.dp_rank} "
                f"sp={self.sp_rank})")


def require_world(layout: Layout) -> int:
    """This process's global rank; the initialised process group must have layout.world ranks."""
    if not dist.is_available() or not dist.is_initialized():
        raise SppoError(f"the layout {layout} needs torch.distributed: launch with `torchrun --nproc-per-node "
                        f"{layout.world} ...` and call sppo_fx.runtime.distributed.init_from_env() first")
    world = dist.get_world_size()
    if world != layout.world:
        raise SppoError(f"stages={layout.pp}, data_parallel={layout.dp}, seq_parallel={layout.sp} need "
                        f"{layout.world} ranks but the process group has {world} ranks; "
                        f"launch with --nproc-per-node {layout.world}, or change stages / data_parallel / "
                        "seq_parallel so that their product is the world size")
    return dist.get_rank()
