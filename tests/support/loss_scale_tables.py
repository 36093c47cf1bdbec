"""Hand-written tables of the dynamic loss scaler's state machine (DeepSpeed's semantics): what the scale
and the hysteresis left are after each step of a run of overflows and good steps."""

F, T = False, True  # overflow?

# Each row: (overflow, scale after the step, hysteresis left after the step)
WINDOW_3_HYSTERESIS_2 = [
    (F, 16, 2),
    (F, 16, 2),
    (F, 32, 2),  # 3 good steps in a row: grow
    (T, 32, 1),  # first overflow is tolerated (step still skipped)
    (T, 16, 1),  # second backs off
    (F, 16, 1),  # the tolerance refills only when the scale grows
    (F, 16, 1),
    (F, 32, 2),
    (T, 32, 1),
    (F, 32, 1),
    (T, 16, 1),
    (T, 8, 1),
]
CONSECUTIVE = [
    (F, 16, 2),
    (F, 16, 2),
    (F, 32, 2),
    (T, 32, 1),
    (F, 32, 2),  # refilled after one good step
    (T, 32, 1),
    (T, 16, 1),
    (F, 16, 2),
    (F, 16, 2),
    (F, 32, 2),  # the window restarted at the last overflow
]
