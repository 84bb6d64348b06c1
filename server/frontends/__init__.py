"""Front-end processes: the servers of one front-end, and with --frontends N the others, how the
primary tells them the models, and how it runs them."""
