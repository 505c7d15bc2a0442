"""Gluon helpers for exchanging fp32 values between CTAs through tagged 64-bit words in global memory,
(tag << 32 | fp32 bits), with relaxed accesses and no fence: a word's tag and value arrive together
(single-copy atomicity of an aligned 64-bit access), and a zeroed buffer never holds a stale tag.
Used by probe_ce_relaxed_barrier.py's tagged variant and benchmarks/session11/probe_ce_lanes.py (imported
into generated copies of the library kernel).
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _publish(word_ptr, tag, value):
    # One thread per CTA stores (tag << 32 | bits of value) with one relaxed 64-bit store: no fence.
    bits = value.to(gl.uint32, bitcast=True).to(gl.uint64) | (tag.to(gl.uint64) << 32)
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred lead;\n\t.reg .b32 t;\n\tmov.u32 t, %tid.x;\n\tsetp.eq.u32 lead, t, 0;\n\t"
        "@lead st.relaxed.gpu.global.b64 [$1], $2;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,l", [word_ptr, bits], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _claim_row_tagged(counter_ptr, word_ptr, tag):
    # Thread 0 of CTA 0 of a cluster claims the next row and publishes it tagged (no cluster barrier after).
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred lead;\n\t.reg .b32 who, got;\n\t.reg .b64 w;\n\tmov.u32 who, %cluster_ctarank;\n\t"
        "mov.u32 got, %tid.x;\n\tor.b32 who, who, got;\n\tsetp.eq.u32 lead, who, 0;\n\t"
        "@lead atom.global.add.u32 got, [$1], 1;\n\tmov.b64 w, {got, $2};\n\t"
        "@lead st.relaxed.gpu.global.b64 [$3], w;\n\tmov.u32 $0, 0;\n\t}",
        "=r,l,r,l", [counter_ptr.to(gl.int64), tag, word_ptr.to(gl.int64)], dtype=gl.int32, is_pure=False,
        pack=1)  # addresses as integers: triton 3.6 cannot broadcast two pointers of different types


@gluon.jit
def _load_word(word_ptr):
    # One relaxed 64-bit load per element (a scalar pointer or a tensor of them).
    return gl.inline_asm_elementwise("ld.relaxed.gpu.global.b64 $0, [$1];", "=l,l", [word_ptr],
                                     dtype=gl.uint64, is_pure=False, pack=1)


@gluon.jit
def _collect(word_ptr, tag):
    # Spin until the word carries this row's tag; its low 32 bits are the value.
    w = _load_word(word_ptr)
    while (w >> 32).to(gl.int32) != tag:
        w = _load_word(word_ptr)
    return (w & 0xFFFFFFFF).to(gl.uint32)


# For benchmarks/session11/probe_ce_lanes.py: a CTA's own claim, and the checks on a vector of words.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # triton 3.6 / 3.9 names


@gluon.jit
def _claim_to_slot(counter_ptr, slot_ptr):
    # Thread 0 of the CTA: *slot = counter++ (relaxed: the claim orders nothing). The CTA's other threads
    # read the slot after its next CTA barrier.
    gl.inline_asm_elementwise(
        "{\n\t.reg .pred lead;\n\t.reg .b32 t, got;\n\tmov.u32 t, %tid.x;\n\tsetp.eq.u32 lead, t, 0;\n\t"
        "@lead atom.relaxed.gpu.global.add.u32 got, [$1], 1;\n\t@lead st.global.u32 [$2], got;\n\t"
        "mov.u32 $0, 0;\n\t}",
        "=r,l,l", [counter_ptr, slot_ptr], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _all_tagged(words, tag):
    # 1 when every word of the vector carries the tag, else 0.
    return gl.min(((words >> 32).to(gl.int32) == tag).to(gl.int32), 0)


@gluon.jit
def _values(words):
    return (words & 0xFFFFFFFF).to(gl.uint32).to(gl.float32, bitcast=True)
