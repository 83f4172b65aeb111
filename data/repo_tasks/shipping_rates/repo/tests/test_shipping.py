from shop.shipping import shipping_cost


def test_express_over_the_threshold_is_charged():
    assert shipping_cost(2, 150, express=True) == 15.0


def test_standard_over_the_threshold_is_free():
    assert shipping_cost(2, 150) == 0.0
