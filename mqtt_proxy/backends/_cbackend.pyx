# cython: language_level=3, boundscheck=False, wraparound=False, cdivision=True
"""Entries -> the messages this proxy appended lately (its recent runs), compiled (`backend.py`
holds the pure twin, `from_recent_py`; tests/test_speedups.py compares them).
"""


def from_recent(list entries, dict parts, list out):
    """out[i] = the message of entries[i] ((log topic, partition, offset) or None) found in
    `parts` ({(log topic, partition): (run base offsets, runs of messages)}, bases ascending);
    returns the indexes of the entries not found. Twin of `backend.from_recent_py`."""
    cdef list missing = []
    cdef list run = None, bases, rs
    cdef tuple et, part
    cdef Py_ssize_t i, n = len(entries), j, lo, hi, mid, o, base = 0
    cdef object e, t, p, lt = None, lp = None
    for i in range(n):
        e = entries[i]
        if e is None:
            continue
        et = <tuple?>e
        t = et[0]
        p = et[1]
        o = et[2]
        if run is not None and (t is lt or t == lt) and (p is lp or p == lp):
            j = o - base
            if 0 <= j < len(run):
                out[i] = run[j]
                continue
        got = parts.get((t, p))
        if got is not None:
            part = <tuple?>got
            bases = <list?>part[0]
            rs = <list?>part[1]
            lo = 0
            hi = len(bases)
            while lo < hi:  # bisect_right(bases, o)
                mid = (lo + hi) >> 1
                if o < <Py_ssize_t>bases[mid]:
                    hi = mid
                else:
                    lo = mid + 1
            if lo > 0:
                j = o - <Py_ssize_t>bases[lo - 1]
                if j < len(<list>rs[lo - 1]):
                    run = <list>rs[lo - 1]
                    base = <Py_ssize_t>bases[lo - 1]
                    lt = t
                    lp = p
                    out[i] = run[j]
                    continue
        missing.append(i)
    return missing
