"""The rows rank 0 prints, in nccl-tests' columns."""

from __future__ import annotations

from collections.abc import Sequence

_GROUP_COLUMNS = ("time(us)", "algbw", "busbw", "#wrong", "%mem")
_GROUP_UNITS = ("(us)", "(GB/s)", "(GB/s)", "", "")
_GROUP_WIDTHS = (11, 8, 8, 7, 6)
_ROW_COLUMNS = ("size", "count", "type", "redop")
_ROW_UNITS = ("(B)", "(elements)", "", "")
_ROW_WIDTHS = (12, 12, 9, 8)
_RATIO_COLUMNS = ("time", "busbw")
_RATIO_WIDTHS = (7, 7)


def cells(values: Sequence[str], widths: Sequence[int]) -> str:
    """Right-aligned cells, each led by at least one space even when it overflows."""
    return "".join(f" {v:>{w - 1}}" for v, w in zip(values, widths))


def header_lines(kd_label: str, mpi_label: str | None) -> list[str]:
    """The three header lines: group titles, column names, units."""
    row_width = sum(_ROW_WIDTHS)
    group_width = sum(_GROUP_WIDTHS)
    titles = " " * (row_width - 1) + f"{kd_label:>{group_width}}"
    names = cells(_ROW_COLUMNS, _ROW_WIDTHS)[1:] + cells(_GROUP_COLUMNS, _GROUP_WIDTHS)
    units = cells(_ROW_UNITS, _ROW_WIDTHS)[1:] + cells(_GROUP_UNITS, _GROUP_WIDTHS)
    if mpi_label is not None:
        titles += f"{mpi_label:>{group_width}}" + f"{'kd/mpi':>{sum(_RATIO_WIDTHS)}}"
        names += cells(_GROUP_COLUMNS, _GROUP_WIDTHS) + cells(_RATIO_COLUMNS, _RATIO_WIDTHS)
        units += cells(_GROUP_UNITS, _GROUP_WIDTHS) + cells(("", ""), _RATIO_WIDTHS)
    return ["#" + titles, "#" + names, "#" + units]


def _group_cells(seconds: float, algbw: float, busbw: float, wrong: int | None,
                 mem_gbps: float) -> list[str]:
    percent = f"{100 * busbw / mem_gbps:.1f}" if mem_gbps > 0 else "n/a"
    return [f"{seconds * 1e6:.2f}", f"{algbw:.3f}", f"{busbw:.3f}",
            "N/A" if wrong is None else str(wrong), percent]


def format_row(size_bytes: int, count: int, dtype_name: str, redop: str,
               kd: tuple[float, float, float, int | None], mem_gbps: float,
               mpi: tuple[float, float, float, int | None] | None = None) -> str:
    """One table row; ``kd``/``mpi`` are (seconds, algbw, busbw, wrong or None)."""
    line = cells([str(size_bytes), str(count), dtype_name, redop], _ROW_WIDTHS)
    line += cells(_group_cells(*kd, mem_gbps), _GROUP_WIDTHS)
    if mpi is not None:
        line += cells(_group_cells(*mpi, mem_gbps), _GROUP_WIDTHS)
        time_ratio = f"{kd[0] / mpi[0]:.2f}" if mpi[0] > 0 else "n/a"
        bus_ratio = f"{kd[2] / mpi[2]:.2f}" if mpi[2] > 0 else "n/a"
        line += cells([time_ratio, bus_ratio], _RATIO_WIDTHS)
    return line
