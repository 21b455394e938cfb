"""The link emulator for real UDP traffic: the emulated link (rate, delay, seeded loss), its UDP relay and
its network-namespace/TUN front ends, and `pfec emulate`."""
