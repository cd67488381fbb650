"""The activator (``warmpool activator``): scale to zero without losing a request.

watch.py lists and watches; pools.py is what the watches know; demand.py tells the operator
what is held; proxy.py holds and forwards; app.py wires them and serves.
"""
