"""The router: picks a prefill and a decode worker for each request (`python -m tokenyard.services.router`)."""
