"""How many blocks a launch needs: ceil_div(n, block) blocks of `block` threads cover n elements (the last
block's threads past n return at once). Every kernel file's launcher uses it, the fast ones too."""


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b
