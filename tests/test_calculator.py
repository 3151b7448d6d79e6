"""plainrl_calculator's tool: integer arithmetic, and an error string for anything else."""

from plainrl_calculator.tools import calculate


def test_calculator_evaluates_integer_arithmetic_and_refuses_the_rest():
    assert calculate("12*(3+4)") == "84" and calculate("-2-3") == "-5"
    assert calculate("2**100").startswith("error:") and calculate("__import__('os')").startswith("error:")
    assert calculate("1/2").startswith("error:") and calculate("3+").startswith("error:")
