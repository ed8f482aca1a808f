"""``mha build``: compile the native kernels ahead of time and say what they target.

Builds ``mha_flash`` (``mha.ops.flash``), its fused backward ``mha_flash_bwd``, ``mha_decode``
(``mha.ops.decode``), ``mha_linear`` (``mha.linear``, the module's projections) and ``mha_gemv``
(``mha.ops.gemv``, the LLM's packed decode projections). Prints the
instruction sets compiled into the flash kernel (e.g. AVX-512F, AVX512_BF16, AMX, or
``amx-emulated``: software tiles in a ``MHA_AMX_EMULATE=1`` build), the tiles each dtype runs,
the backward's products for bf16 inputs (AMX tiles, vdpbf16ps or fp32), the decode kernel's
bf16 q.k (and, where the build has AMX tiles the OS refuses, why they are not used), the
compiler and the cache path, and how the bf16 tiles were chosen (measured on this CPU: the
two kernels' times, :mod:`mha.ops.flash_choice`; or why nothing was measured).
``--remeasure`` measures again the flash kernels' bf16 choice
(:func:`mha.ops.flash_choice.remeasure`) and the projections' GEMM choices recorded for this
machine (:func:`mha.ops.linear_choice.remeasure`) and prints each with the conditions it was
taken under. Exit code 1 when a build fails, the cache directory cannot be
used, or a forcing variable (``MHA_FLASH_BF16``, ``MHA_DECODE_BF16``) names a kernel this build
cannot run (the reason is printed, one line).
"""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("build", help="compile the native CPU kernels now (cached) and print "
                                     "the instruction sets they target")
    p.add_argument("--verbose", action="store_true", help="show the compiler's output")
    p.add_argument("--remeasure", action="store_true",
                   help="measure again the flash kernels' bf16 choice (avx512bf16 or avx512f: "
                        "mha_flash-choice.json) and the projections' GEMM choices recorded for "
                        "this machine (native tiles or torch's, per shape class: "
                        "mha_linear-choice.json), e.g. after they were measured on a loaded "
                        "machine")
    p.set_defaults(func=run)


def run(args) -> int:
    import time
    import warnings

    from mha.ops import build, flash

    print(f"compiler: {build.compiler() or 'none found'}")
    with warnings.catch_warnings(record=True) as notes:  # said here in one line, not twice
        warnings.simplefilter("always")
        try:
            root = build.cache_root()
        except build.BuildError as e:
            print(f"mha build: {e}")
            return 1
    print(f"cache:    {root}" + "".join(f" ({n.message})" for n in notes))
    from mha.ops import decode, gemv, linear

    others = ((flash.BWD_NAME, flash.BWD_SOURCES), (decode.EXTENSION, decode.SOURCES),
              (linear.NAME, linear.SOURCES), (gemv.NAME, gemv.SOURCES))
    # every missing extension at once, one per CPU (--verbose: one by one, the compiler's
    # output in order); then each is loaded (and any that failed built again, saying why)
    built = {} if args.verbose else build.prebuild(((flash.NAME, flash.SOURCES), *others))
    start = time.perf_counter()
    try:
        lib = build.load(flash.NAME, flash.SOURCES, verbose=args.verbose)
    except build.BuildError as e:
        print(f"{flash.NAME}: build FAILED: {e}")
        return 1
    isa = flash.isa().split(",")
    print(f"{flash.NAME}: {lib} ({built.get(flash.NAME, time.perf_counter() - start):.1f} s)")
    print(f"  AVX-512F:    {'yes' if 'avx512f' in isa else 'no (portable loops)'}")
    print(f"  AVX512_BF16: {'yes' if 'avx512bf16' in isa else 'no (bf16 widened to fp32)'}")
    print(f"  compiled in: {', '.join(isa)}")
    status = 0
    picked = _or_refusal(flash.kernels)
    if isinstance(picked, str):  # MHA_FLASH_BF16 names a kernel this build cannot run
        print(f"  tiles used:  bfloat16 refused: {picked}")
        status = 1
    else:
        emulated = "amx-emulated" in isa
        soft = " (software tiles: a MHA_AMX_EMULATE=1 build, for tests, not for speed)"
        print(f"  tiles used:  float32 -> {picked['float32']}, bfloat16 -> {picked['bfloat16']}"
              + (soft if emulated and picked["bfloat16"] == "amx" else ""))
        print(f"  bfloat16 choice: {flash.bf16_said()}")
        if flash.amx_refused() is not None:
            print(f"  AMX tiles not used: {flash.amx_refused()}")
    for name, sources in others:
        status |= _build_other(name, sources, built.get(name))
    if flash.load_backward() is None:
        import torch

        math = _or_refusal(torch.ops.mha.flash_attention_bwd_bf16_math)
        print(f"  backward, bfloat16 inputs: {BACKWARD_WORDS.get(math, math)}")
        status |= math.startswith("refused: ")
    if decode.unavailable() is None:
        qk = _or_refusal(decode.bf16_qk)
        refused = qk.startswith("refused: ")
        why = None if refused else decode.amx_refused()
        print(f"  decode, bfloat16 q.k: {qk}" + (f" (not AMX: {why})" if why else ""))
        status |= refused
    if args.remeasure:
        status |= _remeasure_flash() | _remeasure()
    return status


def _remeasure_flash() -> int:
    """``--remeasure``: the flash kernels' bf16 choice measured again (where one was measured:
    not forced, no AMX, a vdpbf16ps kernel built); one line, the record before and after."""
    from mha.ops import build, flash, flash_choice

    if flash.unavailable() is not None or \
            not isinstance(flash.bf16_choice(), flash_choice.Measured):
        return 0
    try:
        before, after = build.ask(lambda: flash_choice.remeasure(flash.kernel_key()))
    except build.BuildError as e:
        print(f"remeasure: {e}")
        return 1
    was = "no sane record" if before is None else f"was {before.choice}"
    print(f"remeasured flash {flash_choice.NAME}: {after.choice} ({was}; the next process runs "
          f"it): {after.describe()}")
    return 0


def _remeasure() -> int:
    """``--remeasure``: every GEMM choice recorded for this machine, measured again; one line
    each, the record before and after with its conditions (load, the rounds' spread)."""
    from mha.ops import build, linear, linear_choice

    reason = linear.load()
    if reason is not None:
        print(f"remeasure: nothing to measure: {reason}")
        return 1
    try:
        done = linear_choice.remeasure(linear.kernel())
    except build.BuildError as e:
        print(f"remeasure: {e}")
        return 1
    if not done:
        print("remeasure: no GEMM choice recorded for this machine yet (each shape class is "
              "measured at its first projection)")
    for name, before, after in done:
        was = "no sane record" if before is None else f"was {before.choice}"
        print(f"remeasured {name}: {after.choice} ({was}): {after.describe()}")
    return 0


def _or_refusal(fn):
    """``fn()``, or the refusal's one line when a forcing variable names a kernel this build
    cannot run (:mod:`mha.ops.forcing`); any other error propagates."""
    from mha.ops import forcing

    try:
        return fn()
    except RuntimeError as e:
        if not forcing.is_refusal(e):
            raise
        return f"refused: {str(e).strip().splitlines()[0]}"


# The fused backward's products for bf16 inputs (from one 64-row, 64-key block on), in words.
BACKWARD_WORDS = {"amx": "amx tiles (tdpbf16ps)", "bf16": "bf16 products (vdpbf16ps)",
                  "fp32": "fp32 products"}


def _build_other(name: str, sources: tuple[str, ...], seconds: float | None) -> int:
    """The fused backward, decode, the projections and the packed GEMV are extensions of their
    own, built here too (``seconds``: the build's time where :func:`mha.ops.build.prebuild`
    built it)."""
    import time

    from mha.ops import build

    start = time.perf_counter()
    try:
        lib = build.load(name, sources)
    except build.BuildError as e:
        print(f"{name}: build FAILED: {e}")
        return 1
    took = seconds if seconds is not None else time.perf_counter() - start
    print(f"{name}: {lib} ({took:.1f} s)")
    return 0
