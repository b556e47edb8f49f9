from holmes_sim.cli import app

app()
