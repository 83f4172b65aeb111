from money.amounts import to_cents


def test_half_up():
    assert to_cents("2.675") == "2.68"


def test_whole_amount():
    assert to_cents("10") == "10.00"
