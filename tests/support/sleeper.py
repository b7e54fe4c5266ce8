"""A process that only waits (killed by the test that started it): a stand-in for another
program holding a port, whose command line the test chooses."""

import time

if __name__ == "__main__":
    time.sleep(60)
