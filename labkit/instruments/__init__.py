"""The course's instruments: what the notebooks use to see the engine. Simulators that run
the engine's rules on a cost model (`kv_sim.py`, `serve_sim.py`), the Gantt timeline of the
bubble (`timeline.py`), a request's life event by event (`lifecycle.py`) and the roofline plot
(`roofline_plot.py`). The engine never imports them."""
