"""Make Triton 3.6's CPU interpreter (TRITON_INTERPRET=1) usable for our kernels.

Its `int(tensor)` does `int(ndarray)` on a one-element array of rank 1, which NumPy >= 2.4
rejects ("only 0-dimensional arrays can be converted to Python scalars"); our kernels hit it in
`for d in range(world)`. This takes the element instead. Applied once, only when interpreting.
"""
_done = False


def patch_interpreter() -> None:
    global _done
    if _done:
        return
    import triton.runtime.interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patched
    _done = True
