"""What the client test scripts share: checks that run as they are defined, in order,
each counted once it passes (a failing one raises, and the script exits non-zero)."""

PASSED = []


def check(name):
    def wrap(fn):
        fn()
        PASSED.append(name)
        return fn
    return wrap
