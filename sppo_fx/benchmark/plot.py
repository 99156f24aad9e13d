"""The picture of a benchmark: step time against peak extra memory, one point per row,
anchors marked, the Pareto front drawn ("what does each GiB of memory cost me in time?").

Written without plotting libraries: an SVG (self-contained, labelled, opens in any
browser), a PNG (pure Python: zlib + struct; points, front, axes with numbered ticks; the
points' names are in the SVG and the terminal plot), and a text plot for the terminal.
"""
from __future__ import annotations

import dataclasses
import struct
import zlib
from html import escape


@dataclasses.dataclass
class Point:
    label: str
    seconds: float
    peak_bytes: float
    anchor: bool = False


def pareto_front(points: list[Point]) -> list[int]:
    """Indices of the points no other point beats in both time and memory (less or equal
    in both, less in one), ordered by memory."""
    order = sorted(range(len(points)), key=lambda i: (points[i].peak_bytes, points[i].seconds))
    front, best = [], float("inf")
    for i in order:
        if points[i].seconds < best:
            front.append(i)
            best = points[i].seconds
    return front


def points_of(rows: list[dict]) -> list[Point]:
    return [Point(r["label"], r["step_s"], r["peak_extra_bytes"], r.get("anchor", False))
            for r in rows if "error" not in r]


W, H, LEFT, RIGHT, TOP, BOTTOM = 720, 440, 70, 20, 30, 50
COLORS = {"library": (31, 119, 180), "anchor": (255, 127, 14), "front": (214, 39, 40), "axis": (0, 0, 0),
          "grid": (220, 220, 220), "bg": (255, 255, 255)}


def _scale(points: list[Point]):
    xmax = max(p.peak_bytes for p in points) / 2**20 * 1.08 or 1.0
    ymax = max(p.seconds for p in points) * 1.08 or 1.0

    def to_px(p: Point) -> tuple[int, int]:
        x = LEFT + (p.peak_bytes / 2**20) / xmax * (W - LEFT - RIGHT)
        y = H - BOTTOM - p.seconds / ymax * (H - TOP - BOTTOM)
        return int(round(x)), int(round(y))
    return xmax, ymax, to_px


def _hex(rgb) -> str:
    return "#%02x%02x%02x" % rgb


def write_svg(points: list[Point], path: str, title: str = "") -> None:
    """The labelled picture; front points carry class="front", the front line class="front-line"."""
    xmax, ymax, to_px = _scale(points)
    front = pareto_front(points)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" '
           f'font-size="11"><rect width="{W}" height="{H}" fill="white"/>',
           f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="13">{escape(title)}</text>']
    for k in range(6):  # grid and ticks
        gx = LEFT + k * (W - LEFT - RIGHT) / 5
        gy = H - BOTTOM - k * (H - TOP - BOTTOM) / 5
        out.append(f'<line x1="{gx:.0f}" y1="{TOP}" x2="{gx:.0f}" y2="{H - BOTTOM}" stroke="#ddd"/>'
                   f'<text x="{gx:.0f}" y="{H - BOTTOM + 15}" text-anchor="middle">{xmax * k / 5:.4g}</text>')
        out.append(f'<line x1="{LEFT}" y1="{gy:.0f}" x2="{W - RIGHT}" y2="{gy:.0f}" stroke="#ddd"/>'
                   f'<text x="{LEFT - 6}" y="{gy + 4:.0f}" text-anchor="end">{ymax * k / 5:.3g}</text>')
    out.append(f'<polyline points="{LEFT},{TOP} {LEFT},{H - BOTTOM} {W - RIGHT},{H - BOTTOM}" fill="none" '
               f'stroke="black"/><text x="{(LEFT + W - RIGHT) / 2}" y="{H - 12}" text-anchor="middle">'
               f'peak extra memory (MiB)</text><text x="16" y="{(TOP + H - BOTTOM) / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {(TOP + H - BOTTOM) / 2})">step time (s)</text>')
    line = " ".join("%d,%d" % to_px(points[i]) for i in front)
    out.append(f'<polyline class="front-line" points="{line}" fill="none" stroke="{_hex(COLORS["front"])}" '
               f'stroke-width="2"/>')
    for i, p in enumerate(points):
        x, y = to_px(p)
        color = _hex(COLORS["anchor" if p.anchor else "library"])
        cls = "front" if i in front else "point"
        shape = (f'<rect x="{x - 5}" y="{y - 5}" width="10" height="10" fill="{color}"' if p.anchor
                 else f'<circle cx="{x}" cy="{y}" r="5" fill="{color}"')
        stroke = f' stroke="{_hex(COLORS["front"])}" stroke-width="2"' if i in front else ""
        out.append(f'<g class="{cls}" data-label="{escape(p.label)}">{shape}{stroke}/>'
                   f'<text x="{x + 8}" y="{y - 6}">{escape(p.label)}</text></g>')
    out.append(f'<text x="{W - RIGHT}" y="{TOP + 12}" text-anchor="end">square: anchor, circle: sppo_fx, '
               f'red outline and line: Pareto front</text></svg>')
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")


class _Canvas:
    def __init__(self):
        self.px = bytearray(bytes(COLORS["bg"]) * (W * H))

    def dot(self, x: int, y: int, rgb) -> None:
        if 0 <= x < W and 0 <= y < H:
            i = 3 * (y * W + x)
            self.px[i:i + 3] = bytes(rgb)

    def line(self, x0, y0, x1, y1, rgb, width=1) -> None:
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(n + 1):
            x, y = round(x0 + (x1 - x0) * k / n), round(y0 + (y1 - y0) * k / n)
            for dx in range(-(width // 2), width - width // 2):
                for dy in range(-(width // 2), width - width // 2):
                    self.dot(x + dx, y + dy, rgb)

    def mark(self, x, y, rgb, square: bool, r=5) -> None:
        for dx in range(-r, r + 1):
            for dy in range(-r, r + 1):
                if square or dx * dx + dy * dy <= r * r:
                    self.dot(x + dx, y + dy, rgb)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * W * y:3 * W * (y + 1)]) for y in range(H))  # filter 0

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        header = struct.pack(">IIBBBBB", W, H, 8, 2, 0, 0, 0)  # 8-bit RGB
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 6))
                + chunk(b"IEND", b""))


# 3x5 glyphs (rows top to bottom, 3 bits each) for the PNG's tick labels and units
_GLYPHS = {"0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
           "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
           "8": "111101111101111", "9": "111101111001111", ".": "000000000000010", "e": "000111111100111",
           "+": "000010111010000", "-": "000000111000000", "s": "000111100001111", "M": "101111111101101",
           "i": "010000010010010", "B": "110101110101110", " ": "000000000000000"}


def _text(c: "_Canvas", x: int, y: int, text: str, rgb=(0, 0, 0), scale: int = 2, right: bool = False) -> None:
    if right:
        x -= len(text) * 4 * scale
    for k, ch in enumerate(text):
        bits = _GLYPHS.get(ch, _GLYPHS[" "])
        for b, on in enumerate(bits):
            if on == "1":
                for dx in range(scale):
                    for dy in range(scale):
                        c.dot(x + k * 4 * scale + (b % 3) * scale + dx, y + (b // 3) * scale + dy, rgb)


def write_png(points: list[Point], path: str) -> None:
    """The picture as a PNG (see the module docstring)."""
    xmax, ymax, to_px = _scale(points)
    front = pareto_front(points)
    c = _Canvas()
    for k in range(6):
        gx = int(LEFT + k * (W - LEFT - RIGHT) / 5)
        gy = int(H - BOTTOM - k * (H - TOP - BOTTOM) / 5)
        c.line(gx, TOP, gx, H - BOTTOM, COLORS["grid"])
        c.line(LEFT, gy, W - RIGHT, gy, COLORS["grid"])
        _text(c, gx - 12, H - BOTTOM + 8, f"{xmax * k / 5:.4g}")
        _text(c, LEFT - 6, gy - 5, f"{ymax * k / 5:.3g}", right=True)
    _text(c, W - RIGHT - 40, H - BOTTOM + 28, "MiB")
    _text(c, LEFT - 30, TOP - 20, "s")
    c.line(LEFT, TOP, LEFT, H - BOTTOM, COLORS["axis"], 2)
    c.line(LEFT, H - BOTTOM, W - RIGHT, H - BOTTOM, COLORS["axis"], 2)
    for a, b in zip(front, front[1:]):
        c.line(*to_px(points[a]), *to_px(points[b]), COLORS["front"], 2)
    for i, p in enumerate(points):
        x, y = to_px(p)
        if i in front:
            c.mark(x, y, COLORS["front"], p.anchor, 7)
        c.mark(x, y, COLORS["anchor" if p.anchor else "library"], p.anchor, 5)
    with open(path, "wb") as f:
        f.write(c.png())


def text_plot(points: list[Point], width: int = 60, height: int = 16) -> str:
    """The picture in characters: points numbered, the front's numbers in brackets below."""
    if not points:
        return ""
    front = pareto_front(points)
    xmax = max(p.peak_bytes for p in points) or 1.0
    ymax = max(p.seconds for p in points) or 1.0
    grid = [[" "] * width for _ in range(height)]
    for i, p in enumerate(points):
        x = min(width - 1, int(p.peak_bytes / xmax * (width - 1)))
        y = height - 1 - min(height - 1, int(p.seconds / ymax * (height - 1)))
        mark = str(i % 10) if i < 10 else chr(ord("a") + (i - 10) % 26)
        grid[y][x] = mark
    lines = [f"{ymax:8.3g} s |" + "".join(grid[0])]
    lines += ["           |" + "".join(row) for row in grid[1:]]
    lines.append("         0 +" + "-" * width)
    lines.append(" " * 12 + "0" + " " * (width - 12) + f"{xmax / 2**20:.0f} MiB")
    for i, p in enumerate(points):
        mark = str(i % 10) if i < 10 else chr(ord("a") + (i - 10) % 26)
        tag = " [Pareto front]" if i in front else ""
        lines.append(f"  {mark}: {p.label}{' (anchor)' if p.anchor else ''}: {p.seconds:.3f} s, "
                     f"{p.peak_bytes / 2**20:.0f} MiB{tag}")
    return "\n".join(lines)


def write_picture(points: list[Point], path: str, title: str = "") -> list[str]:
    """`path` ending in .svg: the SVG; otherwise the PNG at `path` and the SVG beside it.
    Returns the files written."""
    if path.lower().endswith(".svg"):
        write_svg(points, path, title)
        return [path]
    write_png(points, path)
    svg = path.rsplit(".", 1)[0] + ".svg"
    write_svg(points, svg, title)
    return [path, svg]
