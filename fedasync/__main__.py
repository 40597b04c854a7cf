from fedasync.cli import app

app(prog_name="fedasync")
