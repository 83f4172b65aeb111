"""Shipping costs."""

STANDARD_PER_KG = 4.0
EXPRESS_PER_KG = 7.5
FREE_OVER = 100.0


def shipping_cost(weight_kg, order_total, express=False):
    """Standard shipping is free for orders over FREE_OVER; express is never free."""
    if order_total > FREE_OVER:
        return 0.0
    rate = EXPRESS_PER_KG if express else STANDARD_PER_KG
    return round(weight_kg * rate, 2)
