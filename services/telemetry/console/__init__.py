"""The ops console's static assets (HTML, JS, CSS), served as they are: no build step."""
