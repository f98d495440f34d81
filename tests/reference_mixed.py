"""Plain numpy reference of the error-bounded mode's "mixed" wire format
(kernels/mixed.py, docs/FORMAT.md), written from the spec: the same bytes,
built block by block from the other formats' references (reference.py,
reference_formats.py) and an int16 quantizer written here.  Bounds are the
same float64 expressions in the same order, so the same tags are chosen.
DELTA (kernels/delta.py) is written here from its docstring: grid indices
in float64, differences zigzagged, packed per group of 32 in Python
integers."""
import numpy as np
from reference import quantize as q_int8
from reference_formats import Affine, Int4, from_order_key, order_key, tiny_lift

ZERO, INT4, INT4A, INT8, INT8A, INT16, RAW, FLAG, DELTA = range(9)
META = 24
SAFE = 1.0 + 2.0 ** -30
GROUP, U64 = 32, 2.0 ** -53
_INT4, _AFF4, _AFF8 = Int4(), Affine(15), Affine(255)


def pad8(n):
    return (n + 7) & ~7


def consts(acc):
    """(u, eta) of an accumulation type as the kernels use them."""
    if np.dtype(acc) == np.float64:
        return 2.0 ** -53, 2.0 ** -1074
    return 2.0 ** -24, 2.0 ** -150


def sym_bound(a, levels, c, u, eta):
    return 0.0 if a == 0 else (0.5 + c * u) / levels * a + eta


def aff_bound(lo, hi, levels, u, eta):
    return (hi * 0.5 - lo * 0.5) * (1.0 / levels + 32 * u) + 2 * u * max(-lo, hi) + 3 * eta


def delta_bound(s, a, u, eta):
    return s * (0.5 + u + 2.0 ** -50) + a * (u + 5 * U64) + eta


def n_heads(tag):
    return {INT4: 1, INT8: 1, INT16: 1, INT4A: 2, INT8A: 2, DELTA: 3}.get(tag, 0)


def pay_bytes(tag, m, asz):
    return {INT4: pad8((m + 1) // 2), INT4A: pad8((m + 1) // 2), INT8: pad8(m),
            INT8A: pad8(m), INT16: pad8(2 * m), RAW: pad8(m * asz)}.get(tag, 0)


def step(a, room, u, eta, acc):
    """DELTA's step for a block of largest magnitude a, or 0."""
    s0 = (room / SAFE - a * (u + 5 * U64) - eta) / (0.5 + u + 2.0 ** -50) * (1 - 2.0 ** -40)
    smin, smax, qmax = ((2.0 ** -126, 2.0 ** 127, 2.0 ** 24 - 2) if np.dtype(acc) == np.float32
                        else (2.0 ** -1022, 2.0 ** 1023, 2.0 ** 53 - 2))
    if not smin <= s0 <= smax:
        return 0.0
    bits = np.array([s0]).view(np.uint64) & np.uint64((1 << 64) - (1 << 41))
    s = float(bits.view(np.float64)[0])         # 12 significant bits, rounded down
    if not a * (1.0 / s) < qmax or not delta_bound(s, a, u, eta) * SAFE <= room:
        return 0.0
    return s


def estimate(spread, s, m):
    t = spread / s + 2.0
    if not t < 2.0 ** 60:
        return 1 << 40
    w = (2 * int(t)).bit_length()
    return pad8(-(-m // GROUP) + (m * w + 7) // 8)


def delta_encode(v, s, a):
    """DELTA's headers and payload bytes of block v (accumulation type)."""
    q = np.rint(v.astype(np.float64) * (1.0 / s)).astype(np.int64)
    d = np.diff(q, prepend=q[:1])
    z = ((d << 1) ^ (d >> 63)).astype(np.uint64)
    widths, body = [], b""
    for lo in range(0, v.size, GROUP):
        g = [int(t) for t in z[lo:lo + GROUP]]
        w = max(g).bit_length()
        widths.append(w)
        words = -(-len(g) * w // 32)              # little-endian 32-bit words
        body += sum(t << (j * w) for j, t in enumerate(g)).to_bytes(4 * words, "little")
    raw = bytes(widths) + body
    return np.array([s, a, q[0]], v.dtype), raw + bytes(pad8(len(raw)) - len(raw))


def delta_decode(msg, pay, h, m, acc):
    """(values, payload bytes) of a DELTA block at byte pay."""
    s, a, q = float(h[0]), acc.type(h[1]), int(h[2])
    groups = -(-m // GROUP)
    p, vals = pay + groups, []
    for k in range(groups):
        c = min(GROUP, m - k * GROUP)
        w = int(msg[pay + k])
        nbytes = 4 * -(-c * w // 32)
        big = int.from_bytes(msg[p:p + nbytes].tobytes(), "little")
        p += nbytes
        for j in range(c):
            z = (big >> (j * w)) & ((1 << w) - 1)
            q += (z >> 1) ^ -(z & 1)
            vals.append(float(q) * s)           # in float64, as the kernel
    return np.clip(np.array(vals).astype(acc), -a, a), pad8(p - pay)


def magnitude(tag, h, vals):
    """The block's magnitude bound as formats_mixed reports it."""
    if tag == DELTA:
        return h[1]
    if tag in (INT4A, INT8A):
        return max(-h[0], h[1])
    if tag in (INT4, INT8, INT16):
        return h[0]
    if tag == RAW:
        return float(np.abs(vals).max())
    return np.inf if tag == FLAG else 0.0


def tag_bound(tag, h, u, eta):
    """The per-value bound of a block with headers h (floats)."""
    return {INT4: lambda: sym_bound(h[0], 7.0, 40.0, u, eta),
            INT4A: lambda: aff_bound(h[0], h[1], 15.0, u, eta),
            INT8: lambda: sym_bound(h[0], 127.0, 640.0, u, eta),
            INT8A: lambda: aff_bound(h[0], h[1], 255.0, u, eta),
            INT16: lambda: sym_bound(h[0], 32767.0, 163840.0, u, eta),
            DELTA: lambda: delta_bound(h[0], h[1], u, eta)}.get(tag, lambda: 0.0)()


def choose(a, lo, hi, room, u, eta):
    for tag, h in ((INT4, (a,)), (INT4A, (lo, hi)), (INT8, (a,)), (INT8A, (lo, hi)),
                   (INT16, (a,))):
        if tag_bound(tag, h, u, eta) * SAFE <= room:
            return tag
    return RAW


def quantize16(v):
    """INT16 of one finite nonzero block: (a, int16 codes)."""
    acc = v.dtype.type
    a = np.abs(v).max()
    tiny, big = tiny_lift(acc)
    lift = big if a < tiny else acc(1)
    r = acc(32767) / (a * lift)
    return a, np.rint((v * lift) * r).astype(np.int16)


def encode_block(v, room):
    """(tag, headers (array of v's type), payload bytes) of one block."""
    acc = v.dtype.type
    u, eta = consts(acc)
    if not np.isfinite(v).all():
        return FLAG, np.zeros(0, v.dtype), b""
    a = np.abs(v).max()
    if a == 0:
        if not np.signbit(v).any():
            return ZERO, np.zeros(0, v.dtype), b""
        tag = INT4
    else:
        keys = order_key(v)
        lo = float(from_order_key(keys.min(), v.dtype))
        hi = float(from_order_key(keys.max(), v.dtype))
        tag = choose(float(a), lo, hi, room, u, eta)
        s = step(float(a), room, u, eta, v.dtype) if v.size >= GROUP else 0.0
        asz = v.dtype.itemsize
        with np.errstate(over="ignore"):        # as the kernel: Inf compares as such
            spread = float(np.abs(np.diff(v)).max()) if v.size > 1 else 0.0
        if s > 0 and (estimate(spread, s, v.size) + 3 * asz + v.size * 1     # SAVE = 1
                      <= pay_bytes(tag, v.size, asz) + n_heads(tag) * asz):
            h, raw = delta_encode(v, s, float(a))
            return DELTA, h, raw
    m = v.size
    if tag == INT4:
        h, codes, _ = _INT4.quantize(v, m)
    elif tag == INT8:
        h, codes = q_int8(v, m)
    elif tag in (INT4A, INT8A):
        h, codes, _ = (_AFF4 if tag == INT4A else _AFF8).quantize(v, m)
    elif tag == INT16:
        h, codes = quantize16(v)
        h = np.array([h], v.dtype)
    else:
        h, codes = np.zeros(0, v.dtype), v
    raw = np.ascontiguousarray(codes).tobytes()
    return tag, np.asarray(h, v.dtype).reshape(-1), raw + bytes(pad8(len(raw)) - len(raw))


def assemble(tags, heads, payloads, worst, acc):
    nb = len(tags)
    body = b"".join(payloads)
    hoff = META + pad8(nb) + len(body)
    hb = np.concatenate(heads).astype(acc).tobytes() if heads else b""
    used = hoff + pad8(len(hb))
    out = (np.array([used, hoff], np.int64).tobytes() + np.array([worst]).tobytes()
           + bytes(tags) + bytes(pad8(nb) - nb) + body + hb + bytes(pad8(len(hb)) - len(hb)))
    assert len(out) == used
    return np.frombuffer(out, np.uint8)


def encode(v, block, room):
    """The used bytes of a piece of values v (accumulation type) sent with
    per-value budget ``room``."""
    u, eta = consts(v.dtype)
    tags, heads, pays, worst = [], [], [], 0.0
    for lo in range(0, v.size, block):
        tag, h, p = encode_block(v[lo:lo + block], room)
        tags.append(tag)
        heads.append(h)
        pays.append(p)
        if tag != FLAG:
            worst = max(worst, tag_bound(tag, [float(x) for x in h], u, eta))
    return assemble(tags, heads, pays, worst, v.dtype)


def parse(msg, n, block, acc):
    """[(tag, headers, decoded values or None for FLAG)] per block."""
    acc = np.dtype(acc)
    nb = -(-n // block)
    hoff = int(msg[8:16].view(np.int64)[0])
    heads = msg[hoff:].view(acc) if hoff < msg.size else np.zeros(0, acc)
    pay, hd, out = META + pad8(nb), 0, []
    k = {L: acc.type(1) / acc.type(L) for L in (7, 127, 32767)}
    for b in range(nb):
        m = min(block, n - b * block)
        tag = int(msg[META + b])
        nh = n_heads(tag)
        h = heads[hd:hd + nh]
        if tag == DELTA:
            vals, size = delta_decode(msg, pay, h, m, acc)
        elif tag == FLAG:
            vals = None
            size = 0
        elif tag == ZERO:
            vals, size = np.zeros(m, acc), 0
        elif tag == INT4:
            size = pad8((m + 1) // 2)
            vals = _INT4.dequantize((h, msg[pay:pay + (m + 1) // 2], m), m)
        elif tag == INT8:
            size = pad8(m)
            vals = (msg[pay:pay + m].view(np.int8).astype(acc) * k[127]) * h[0]
        elif tag == INT16:
            size = pad8(2 * m)
            vals = (msg[pay:pay + 2 * m].view(np.int16).astype(acc) * k[32767]) * h[0]
        elif tag in (INT4A, INT8A):
            codec = _AFF4 if tag == INT4A else _AFF8
            nbytes = (m + 1) // 2 if tag == INT4A else m
            size = pad8(nbytes)
            vals = codec.dequantize((h, msg[pay:pay + nbytes], m), m)
        else:
            size = pad8(m * acc.itemsize)
            vals = msg[pay:pay + m * acc.itemsize].view(acc).copy()
        out.append((tag, [float(x) for x in h], vals))
        pay += size
        hd += nh
    return out


def owner(own, pos, msgs, block, room):
    """What the two-shot owner sends: the rank-order sum of own (accumulation
    type) in place pos and the decoded messages, each block encoded within
    ``room`` (kernels/mixed.py mx_decode_reduce_encode_many).  Also returns
    the sums (NaN in FLAG blocks)."""
    acc = own.dtype
    u, eta = consts(acc)
    n = own.size
    parsed = [parse(m, n, block, acc) for m in msgs]
    tags, heads, pays, worst, sums = [], [], [], 0.0, []
    for b in range(-(-n // block)):
        sl = slice(b * block, min(n, (b + 1) * block))
        total, flag = None, False
        rows = iter(parsed)
        for t in range(len(msgs) + 1):
            if t == pos:
                val = own[sl]
            else:
                tag, h, val = next(rows)[b]
                if tag == FLAG:
                    flag = True
                    continue
            total = val.copy() if total is None else (total + val).astype(acc)
        if flag or not np.isfinite(total).all():
            tags.append(FLAG)
            heads.append(np.zeros(0, acc))
            pays.append(b"")
            sums.append(np.full(sl.stop - sl.start, np.nan, acc))
            continue
        sums.append(total)
        tag, h, p = encode_block(total, room)
        tags.append(tag)
        heads.append(h)
        pays.append(p)
        worst = max(worst, tag_bound(tag, [float(x) for x in h], u, eta))
    return assemble(tags, heads, pays, worst, acc), np.concatenate(sums)
