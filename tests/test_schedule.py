from qkgeom.training.schedule import lr_at


def test_warmup_then_cosine_to_floor() -> None:
    kw = dict(lr=1.0, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    assert lr_at(0, **kw) == 0.1
    assert lr_at(9, **kw) == 1.0
    assert lr_at(10, **kw) == 1.0
    assert abs(lr_at(60, **kw) - 0.55) < 1e-12  # half-way: mean of peak and floor
    assert abs(lr_at(110, **kw) - 0.1) < 1e-12
    values = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:], strict=False))
