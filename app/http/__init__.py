"""The HTTP front end: /predict, the Open Inference Protocol over REST, the repository API,
health, metrics; its middleware, body limits and error responses. It translates requests into
calls of the serving core (``app.serving``) and its answers back."""
