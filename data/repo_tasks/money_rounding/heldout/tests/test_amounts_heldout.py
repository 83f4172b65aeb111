from decimal import Decimal

import pytest
from money.amounts import to_cents, total


@pytest.mark.parametrize("amount, want", [("0.125", "0.13"), ("1.005", "1.01"),
                                          ("-1.005", "-1.01"), ("2.674", "2.67"),
                                          (Decimal("0.5"), "0.50"), ("1234567.895", "1234567.90")])
def test_to_cents(amount, want):
    assert to_cents(amount) == want


def test_total_is_exact():
    assert total(["0.105", "0.105"]) == "0.21"
    assert total(["0.1"] * 10) == "1.00"
