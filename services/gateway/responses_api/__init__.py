"""OpenAI's Responses API (`/v1/responses`) on top of the chat path: a request and the
stored conversation it continues become one chat request; the answer comes back as
Responses output items, whole or as typed SSE events; responses are kept in SQL."""
