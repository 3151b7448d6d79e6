"""The calculator tool server: `calculate(expression)`, arithmetic on integers, served over MCP by verifiers."""

import ast
import operator

import verifiers.v1 as vf

OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def calculate(expression: str) -> str:
    """The value of an integer expression with + - * and parentheses, or an error the model can read."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return f"error: cannot parse {expression!r}"

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in OPERATORS:
            return OPERATORS[type(node.op)](value(node.left), value(node.right))
        raise ValueError(f"only integers, + - * and parentheses are allowed in {expression!r}")

    try:
        return str(value(tree.body))
    except ValueError as error:
        return f"error: {error}"


class CalculatorToolset(vf.Toolset[vf.SharedToolsetConfig]):
    """One server for the whole run (the tool keeps no state); its tool is offered bare, as `calculate`."""

    TOOL_PREFIX = None

    @vf.tool
    def calculate(self, expression: str) -> str:
        """Evaluate an integer arithmetic expression (+, -, *, parentheses), e.g. "12*(3+4)"."""
        return calculate(expression)


if __name__ == "__main__":  # verifiers starts the server as `python -m plainrl_calculator.tools`
    CalculatorToolset.run()
