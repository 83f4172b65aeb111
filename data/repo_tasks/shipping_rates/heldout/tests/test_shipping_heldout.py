import pytest
from shop.shipping import EXPRESS_PER_KG, STANDARD_PER_KG, shipping_cost


@pytest.mark.parametrize("kg", [0.5, 1, 3.2, 10])
def test_express_is_always_charged(kg):
    for total in (20, 100, 100.01, 999):
        assert shipping_cost(kg, total, express=True) == round(kg * EXPRESS_PER_KG, 2)


def test_the_threshold_is_strict():
    assert shipping_cost(1, 100) == STANDARD_PER_KG
    assert shipping_cost(1, 100.01) == 0.0
