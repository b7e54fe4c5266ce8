"""A process that only waits (killed by the test that started it): a stand-in for another
program holding a port, whose command line the test chooses."""

import signal

if __name__ == "__main__":
    signal.pause()  # until the test's kill
