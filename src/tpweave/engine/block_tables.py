"""BlockTableRows: the block tables of the sequences a runner's steps hold, as rows of one numpy matrix kept across
steps.

A step's block tables built from the sequences' Python lists convert every block id at every step: at 256 decodes of
context 1024 (64 blocks each) that was most of the host's time to build a decode step's inputs. A block table only
grows (the block manager appends to it) or is replaced by a new list when its blocks are freed, so here a sequence's
row takes only the blocks it gained since its last step, and a step's tables are one gather of its sequences' rows.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

import numpy as np


class BlockTableRows:
    """Rows of `width` block ids, one per sequence seen in a recent step, `fill` past a table's end."""

    def __init__(self, num_rows: int, width: int, fill: int):
        self.matrix = np.full((num_rows, width), fill, dtype=np.int32)
        self.fill = fill
        # id(seq) -> [seq, its block table list as last seen, row, blocks copied]; the seq is held so its id stays its
        self._entries: dict[int, list] = {}
        self._free = list(range(num_rows - 1, -1, -1))

    def rows(self, seqs: Seq) -> np.ndarray:
        """The rows of `seqs` (at most num_rows of them), their tables' new blocks copied in first."""
        out = np.empty(len(seqs), dtype=np.int64)
        for i, seq in enumerate(seqs):
            table = seq.block_table
            entry = self._entries.get(id(seq))
            if entry is None or entry[1] is not table or entry[3] > len(table):
                if entry is None:
                    if not self._free:
                        self._evict(seqs)
                    entry = self._entries[id(seq)] = [seq, table, self._free.pop(), 0]
                else:  # freed and allocated again: a new list
                    entry[1], entry[3] = table, 0
                self.matrix[entry[2]] = self.fill
            copied = entry[3]
            if copied < len(table):
                self.matrix[entry[2], copied : len(table)] = table[copied:]
                entry[3] = len(table)
            out[i] = entry[2]
        return out

    def gather(self, seqs: Seq, out: np.ndarray, fill: int) -> np.ndarray:
        """`out` (rows, width) int32: the tables of `seqs` in its first rows (`self.fill` past their ends), `fill` in
        the rest."""
        n, width = len(seqs), out.shape[1]
        have = min(width, self.matrix.shape[1])
        np.take(self.matrix[:, :have], self.rows(seqs), axis=0, out=out[:n, :have])
        out[:n, have:] = self.fill
        out[n:] = fill
        return out

    def _evict(self, keep: Seq) -> None:
        """Free the rows of every sequence not in `keep`."""
        kept = {id(s) for s in keep}
        for key in [k for k in self._entries if k not in kept]:
            self._free.append(self._entries.pop(key)[2])
        if not self._free:
            raise AssertionError(f"a step of {len(keep)} sequences, rows for {self.matrix.shape[0]}")
